"""Calibrating ``run.audit_tolerance`` on the run's own model and task (``intellect-node audit calibrate``).

What we actually do (``tolerance.py`` says why each number is what it is):

1. honest inputs: for each of ``steps`` steps, ``rl.groups_per_step`` groups sampled from the run's
   starting model with the torch engine and the run's sampling settings, on problems of the run's task
   (its assignments, as one worker would be given them), re-scored as the trainer re-scores them
   (``inputs.run_rescorer``); the groups with a signal are what the step trains on;
2. the trainer's condition (``trainer_threads`` torch threads, the run's compute dtype) trains the chain
   of steps and keeps each version's weights and optimizer state (what it would publish);
3. the auditor's condition (``threads`` torch threads) replays each step from the trainer's base weights
   with its own optimizer, as a replay within tolerance goes on from the published weights;
4. the observation is the worst per-tensor difference over every step: of the weights relative to the
   step's update, and of the optimizer's moments relative to their own norm (what ``windows.check_end``
   compares at a checkpoint); the tolerance is ``worst * factor + floor`` of the larger of the two.

Shortcuts: the conditions are thread counts in this process. A CPU with other kernels (the trainer's
avx512 against an auditor's avx2) or a GPU is not emulated here: ``bench/audit.py`` measures the kernels
of this machine's CPU with ``ATEN_CPU_CAPABILITY`` in child processes. Every step trains on rollouts of
the starting model (off-policy after the first; the numerics are the same).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from intellect_node.config.schema import NodeConfig
from intellect_node.roles.auditor.inputs import run_rescorer, run_settings
from intellect_node.roles.auditor.replay import replay_record
from intellect_node.roles.auditor.tolerance import AuditCalibration, AuditMargins, calibrate
from intellect_node.trainer.optim import Optimizer
from intellect_node.trainer.step import Sample

Echo = Callable[[str], None]
Triple = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]


def honest_steps(cfg: NodeConfig, steps: int, *, seed: int = 0, echo: Echo = lambda _: None
                 ) -> list[list[Sample]]:
    """The samples of ``steps`` honest steps of the run (see the module docstring, step 1); steps whose
    groups all had equal rewards are left out."""
    from intellect_node.inference.base import SamplingConfig
    from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.protocol.rollout import RolloutBatch
    from intellect_node.protocol.signing import SigningKey
    from intellect_node.roles.common.models import model_dir
    from intellect_node.roles.common.tasks import run_assignments, run_task

    rl = cfg.rl
    task = run_task(cfg)
    assignments = run_assignments(cfg, task)
    rescorer = run_rescorer(cfg)
    key = SigningKey(random.Random(seed).randbytes(32))
    engine = TorchEngine.from_dir(str(model_dir(cfg)))
    ckpt = checkpoint_cid(engine.loaded.path)
    sampling = SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature)
    per_step = max(1, rl.groups_per_step // rl.problems_per_batch)
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        samples: list[Sample] = []
        for b in range(per_step):
            problems = assignments.problems(key.peer_id, 0, s * per_step + b)
            expanded = [p for p in problems for _ in range(rl.group_size)]
            first = rng.randrange(1 << 30)
            recs = generate_rollouts(engine, engine.loaded.tokenizer, expanded, key=key,
                                     run_id=cfg.run.run_id, policy_version=0, checkpoint=ckpt,
                                     sampling=sampling, seeds=[first + i for i in range(len(expanded))])
            batch = RolloutBatch(run_id=cfg.run.run_id, policy_version=0, rollouts=recs)
            for group in rescorer.groups(batch, key.peer_id, 0):
                if len({x.reward for x in group}) > 1:
                    samples.extend(group)
        echo(f"step {s + 1}/{steps}: {len(samples)} samples with a signal")
        if samples:
            out.append(samples)
    return out


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _optimizer_state(opt: Optimizer) -> dict[str, torch.Tensor]:
    from intellect_node.trainer.optstate import encode_optimizer

    return encode_optimizer(opt).to_state_dict()


def _chain(cfg: NodeConfig, steps: list[list[Sample]], threads: int,
           bases: list[dict[str, torch.Tensor]] | None) -> tuple[list[dict[str, torch.Tensor]],
                                                                  list[dict[str, torch.Tensor]]]:
    """Train ``steps`` with ``threads`` torch threads (each from ``bases[i]`` when given, else from the
    previous step); the weights before the first and after each step, and the optimizer state after each."""
    from intellect_node.protocol.steps import StepRecord
    from intellect_node.roles.common.models import model_dir
    from intellect_node.trainer.model import TrainOptions, load_trainable
    from intellect_node.trainer.step import make_optimizer

    settings = run_settings(cfg)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load_trainable(model_dir(cfg), TrainOptions.from_section(cfg.rl))
        opt = make_optimizer(model, settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
        weights, moments = [_copy(model.state_dict())], []
        rec = StepRecord(run_id=cfg.run.run_id, seq=1, step=1, base_version=0, base_hash="", version=1,
                         checkpoint_hash="", batches=[], settings=settings)
        for i, samples in enumerate(steps):
            if bases is not None:
                model.load_state_dict(bases[i])
            replay_record(model, opt, rec, samples)
            weights.append(_copy(model.state_dict()))
            moments.append(_optimizer_state(opt))
        return weights, moments
    finally:
        torch.set_num_threads(before)


def settings_dtype(cfg: NodeConfig) -> str:
    return run_settings(cfg).compute_dtype or "float32 (the weights' own)"


def calibrate_run(cfg: NodeConfig, steps: list[list[Sample]], *, threads: int, trainer_threads: int = 1,
                  margins: AuditMargins | None = None) -> tuple[AuditCalibration, AuditCalibration]:
    """The calibrations of the weights and of the optimizer state for an auditor with ``threads`` torch
    threads against a trainer with ``trainer_threads`` (module docstring, steps 2-4), on ``steps``."""
    if not steps:
        raise ValueError("no honest steps to calibrate on")
    margins = margins or AuditMargins()
    ref, ref_moments = _chain(cfg, steps, trainer_threads, None)
    mine, my_moments = _chain(cfg, steps, threads, ref[:-1])
    condition = f"cpu, {trainer_threads} thread(s) -> cpu, {threads} thread(s); compute dtype " \
                f"{settings_dtype(cfg)}"
    weights: list[Triple] = [(ref[i], mine[i + 1], ref[i + 1]) for i in range(len(steps))]
    zeros = [{k: torch.zeros_like(v) for k, v in m.items()} for m in my_moments]
    moments: list[Triple] = [(zeros[i], my_moments[i], ref_moments[i]) for i in range(len(steps))]
    return (calibrate(weights, condition=condition, margins=margins),
            calibrate(moments, condition=condition + " (optimizer state)", margins=margins))
