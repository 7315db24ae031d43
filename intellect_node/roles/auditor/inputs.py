"""What an audit needs besides the records: the run's step settings and each batch re-scored into groups.

An auditor expects the settings the run's configuration gives the trainer (:func:`run_settings`, the same
functions the trainer builds its own from), and re-scores each batch from the run's task with the
trainer's own re-scoring (:class:`~intellect_node.roles.trainer.rescore.Rescorer`): the rewards a step
trains on are the trainer's re-computed ones, not the worker's claims. The same checks tell whether the
trainer had cause to refuse a batch it recorded dropped (:func:`trainer_refusal`, ``drops.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from intellect_node.config.schema import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.errors import IntellectNodeError
from intellect_node.models.loader import ModelTokenizer
from intellect_node.protocol.rollout import RolloutBatch, decode_batch
from intellect_node.protocol.steps import StepBatch, StepSettings
from intellect_node.roles.common.grpo import run_grpo_config, settings_of
from intellect_node.roles.common.models import model_dir
from intellect_node.roles.common.rescore import RefusedBatch, Rescorer
from intellect_node.roles.common.tasks import run_assignments, run_task
from intellect_node.trainer.model import TrainOptions
from intellect_node.trainer.step import Sample


def run_settings(cfg: NodeConfig) -> StepSettings:
    """The step settings the run's configuration gives its trainer: ``lr`` is the run's (a step's record
    says the one it used, ``replay.py`` checks it follows), ``micro_tokens`` this node's own (a record's
    is the trainer's, and the replay uses it)."""
    opts = TrainOptions.from_section(cfg.rl)
    return settings_of(run_grpo_config(cfg.rl), lr=cfg.rl.lr, temperature=cfg.rl.temperature,
                       micro_tokens=opts.micro_batch_tokens, compute_dtype=opts.compute_dtype,
                       warmup_steps=cfg.rl.lr_warmup_steps, target_kl=cfg.rl.target_kl)


def run_rescorer(cfg: NodeConfig, board: StatusBoard | None = None) -> Rescorer:
    """The run's re-scoring, as its trainer builds it."""
    task = run_task(cfg)
    tokenizer = ModelTokenizer(model_dir(cfg))
    return Rescorer(task, tokenizer.decode, run_id=cfg.run.run_id, group_size=cfg.rl.group_size,
                    board=board or StatusBoard(role="auditor"), assignments=run_assignments(cfg, task))


def batch_groups(rescorer: Rescorer, fetch: Callable[[str], bytes | None]
                 ) -> Callable[[StepBatch], list[list[Sample]] | None]:
    """A record's batch as groups: its bytes from ``fetch`` (None: not to be had), decoded and re-scored;
    None also when the batch does not decode or re-score (the record named something no trainer took)."""

    def groups(b: StepBatch) -> list[list[Sample]] | None:
        data = fetch(b.cid)
        if data is None:
            return None
        try:
            batch = decode_batch(data)
            return rescorer.groups(batch, b.worker, batch.policy_version)
        except IntellectNodeError:
            return None

    return groups


def trainer_refusal(rescorer: Rescorer) -> Callable[[RolloutBatch, str], str]:
    """The trainer's own check of a batch of a worker at the batch's version (blocking: it re-scores):
    the reason it refuses it (``wrong_task``, ``not_assigned``, ``bad_signature``; ``malformed`` for a
    batch that does not match), "" when it takes it."""

    def refusal(batch: RolloutBatch, worker: str) -> str:
        try:
            rescorer.groups(batch, worker, batch.policy_version)
        except RefusedBatch as exc:
            return exc.reason
        except IntellectNodeError:
            return "malformed"
        return ""

    return refusal
