"""A window of training steps replayed from the trainer's signed step records, and compared with them.

Each record (``protocol/steps.py``) names the policy a step started from, the batches it took in order,
which of their groups it trained on, its settings and the policy it made. :func:`audit_window` takes
the model holding the window's start policy and each batch's groups (re-scored from the task as the
trainer re-scores them, ``roles/trainer/rescore.py``), and for each record in turn:

1. checks the record's settings are the run's, and that it starts where the previous one ended (the
   first: from the weights handed in). Two numbers are the record's own: ``micro_tokens`` (the trainer's
   local micro-batching, which fixes the summation order: the replay uses the record's) and the lr the
   step used, which must follow the run's schedule (``trainer/stepsize.py``): the run's lr x the
   warmup's factor at the record's step x the record's ``lr_scale``, a scale the controller can reach
   and, after a step replayed bit for bit here, exactly the one the controller makes from the KL that
   step measured (the first step of a window has no such step before it: only the bound holds there);
2. checks the groups it says it trained on are exactly those whose rewards are not all equal (the
   online filter, ``trainer/filtering.py``): a trainer that leaves out a group with a signal, or trains
   on one without, is caught here without any compute;
3. runs the GRPO step of ``trainer/step.py`` with the record's settings on those samples and compares
   the canonical hash of the new weights with the record's ``checkpoint_hash``.

Outcomes: ``pass``, ``fail`` (with what was expected and what was published) and ``unavailable`` (the
audit could not run: a batch missing, a group count that the re-scoring here does not reproduce, a
window that does not start at the weights held): never a pass. After a step that did not pass, the rest
of the window is ``unavailable``: the replay no longer holds the published policy.

The optimizer state at the window's start is handed in (one the trainer published with a checkpoint,
loaded by ``windows.load_start``), or made fresh for a window from version 0 (an optimizer holds no state
before its first step). Bitwise equality holds on the CPU with one torch thread (the trainer runs with
``torch.set_num_threads(1)``), the same dtype and the same kernels (measured: two threads are not
reliably bitwise, another CPU's kernels never). Where it does not, a :class:`WindowReplay` given the
run's ``tolerance`` and a way to the published weights (the chain auditor's: ``published.py``) compares a
step whose hash differs within that tolerance (``tolerance.py``) and, when it holds, continues from the
published weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.steps import StepBatch, StepRecord, StepSettings
from intellect_node.roles.auditor.tolerance import compare
from intellect_node.roles.common.grpo import grpo_config_of
from intellect_node.trainer.optim import Optimizer
from intellect_node.trainer.step import Sample, StepStats, make_optimizer, train_step
from intellect_node.trainer.stepsize import in_bounds, measured, next_scale, step_lr

log = logging.getLogger(__name__)

Outcome = Literal["pass", "fail", "unavailable"]
GroupsOf = Callable[[StepBatch], "list[list[Sample]] | None"]
"""A record's batch as the trainer's groups of samples (re-scored); None when the batch cannot be had."""
PublishedOf = Callable[[StepRecord, "Mapping[str, torch.Tensor]"], "PolicyWeights | None"]
"""The weights a record says its step made (its ``checkpoint_hash``), given the weights the step started
from (hash ``base_hash``: a delta applies to them); None when they cannot be had."""


@dataclass(frozen=True)
class StepAudit:
    """One record's audit: ``expected`` is the hash the replay made (empty when it did not run)."""

    seq: int
    version: int
    outcome: Outcome
    published: str
    expected: str = ""
    reason: str = ""


def weights_hash(model: torch.nn.Module) -> str:
    """The canonical hash of ``model``'s weights: what an announcement carries for its version."""
    return PolicyWeights.from_state_dict(model.state_dict()).content_hash


def _signal(group: Sequence[Sample]) -> bool:
    rewards = [s.reward for s in group]
    return bool(rewards) and max(rewards) != min(rewards)


def trained_samples(rec: StepRecord, groups_of: GroupsOf) -> tuple[list[Sample] | None, Outcome, str]:
    """The samples ``rec`` trained on, in order; or None with ``unavailable``/``fail`` and why."""
    samples: list[Sample] = []
    for b in rec.batches:
        groups = groups_of(b)
        if groups is None:
            return None, "unavailable", f"batch {b.cid} could not be fetched"
        if len(groups) != b.groups:
            return None, "unavailable", (f"batch {b.cid} re-scores to {len(groups)} groups here, the record "
                                         f"says {b.groups}")
        with_signal = [i for i, g in enumerate(groups) if _signal(g)]
        if with_signal != b.trained:
            return None, "fail", (f"batch {b.cid}: groups {with_signal} have unequal rewards, the record "
                                  f"trained on {b.trained}")
        samples.extend(s for i in b.trained for s in groups[i])
    return samples, "pass", ""


def replay_record(model: torch.nn.Module, opt: Optimizer, rec: StepRecord, samples: Sequence[Sample]
                  ) -> tuple[str, StepStats]:
    """Train ``model`` one step as ``rec`` says; the new weights' hash and the step's statistics."""
    s = rec.settings
    dtype = None if s.compute_dtype is None else getattr(torch, s.compute_dtype)
    stats = train_step(model, opt, samples, grpo_config_of(s), temperature=s.temperature,
                       micro_tokens=s.micro_tokens, compute_dtype=dtype, lr=s.lr)
    return weights_hash(model), stats


def settings_fault(rec: StepSettings, run: StepSettings, *, step: int, trained: bool,
                   scale: float | None) -> str:
    """Why ``rec`` (a record's settings) are not what the run's ``run`` make at trained-step count ``step``
    (after the step), with ``scale`` the controller's expected scale (None: unknown); "" when they are."""
    own = msgspec.structs.replace(rec, lr=run.lr, micro_tokens=run.micro_tokens, lr_scale=run.lr_scale)
    if own != run:
        return f"settings {rec} are not the run's {run}"
    if not in_bounds(rec.lr_scale, run.target_kl):
        return f"lr_scale {rec.lr_scale} is not one the run's schedule (target_kl {run.target_kl}) reaches"
    if scale is not None and rec.lr_scale != scale:
        return f"lr_scale {rec.lr_scale} is not the {scale} the previous step's KL makes"
    lr = step_lr(run.lr, step - 1 if trained else step, run.warmup_steps, rec.lr_scale)
    if rec.lr != lr:
        return f"lr {rec.lr} is not the {lr} the run's schedule gives step {step}"
    return ""


class WindowReplay:
    """A replay in progress: ``model`` (holding the window's start policy), its optimizer (None: a fresh
    one, for a window from version 0) and the hash of what it holds. :meth:`audit` takes the records one
    at a time, in order; after a step that did not pass, every later one is ``unavailable``.

    ``tolerance`` (the run's ``audit_tolerance``; 0: bitwise only) with ``published``: a step whose hash
    differs passes when its weights are within the tolerance of the published ones (``tolerance.py``)."""

    def __init__(self, model: torch.nn.Module, settings: StepSettings, opt: Optimizer | None = None, *,
                 tolerance: float = 0.0, published: PublishedOf | None = None) -> None:
        self.model = model
        self.settings = settings
        self.opt = opt
        self.tolerance = tolerance
        self.published = published
        self.held = weights_hash(model)
        # The lr scale the controller makes for the next record (None: unknown); a window from version 0
        # (no optimizer state yet) starts where the trainer's controller starts.
        self.scale: float | None = 1.0 if opt is None else None
        self.started = False
        self.stopped = ""  # why the replay no longer holds the published policy ("" while it does)

    def audit(self, rec: StepRecord, groups_of: GroupsOf) -> StepAudit:
        """Audit one record (CPU-heavy: run it in a worker thread)."""
        if self.stopped:
            return StepAudit(rec.seq, rec.version, "unavailable", rec.checkpoint_hash, reason=self.stopped)
        first, self.started = not self.started, True
        if self.held != rec.base_hash:
            if first:
                return self._stop(StepAudit(rec.seq, rec.version, "unavailable", rec.checkpoint_hash,
                                            reason="the weights held are not the window's start"))
            return self._stop(StepAudit(rec.seq, rec.version, "fail", rec.checkpoint_hash, self.held,
                                        f"step {rec.seq} does not start where the previous step ended"))
        fault = settings_fault(rec.settings, self.settings, step=rec.step, trained=rec.trained,
                               scale=self.scale)
        if fault:
            return self._stop(StepAudit(rec.seq, rec.version, "fail", rec.checkpoint_hash, reason=fault))
        samples, outcome, why = trained_samples(rec, groups_of)
        if samples is None:
            return self._stop(StepAudit(rec.seq, rec.version, outcome, rec.checkpoint_hash, reason=why))
        base = None
        if rec.trained:
            if self.opt is None:
                self.opt = make_optimizer(self.model, rec.settings.lr, betas=rec.settings.betas,
                                          weight_decay=rec.settings.weight_decay)
            if self.tolerance > 0:
                base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.held, stats = replay_record(self.model, self.opt, rec, samples)
            # the KL is this replay's own: the next scale is known only after a bitwise step
            kl = measured(stats.kl_sampler, (x.policy_version for x in samples), rec.base_version)
            self.scale = next_scale(rec.settings.lr_scale, kl, rec.settings.target_kl) \
                if self.held == rec.checkpoint_hash else None
        else:
            self.scale = rec.settings.lr_scale  # nothing trained: the controller measured nothing
        if self.held != rec.checkpoint_hash and base is not None:
            return self._within(rec, base)
        if self.held != rec.checkpoint_hash:
            return self._stop(StepAudit(rec.seq, rec.version, "fail", rec.checkpoint_hash, self.held,
                                        "the replayed weights differ from the published ones"))
        return StepAudit(rec.seq, rec.version, "pass", rec.checkpoint_hash, self.held)

    def _within(self, rec: StepRecord, base: dict[str, torch.Tensor]) -> StepAudit:
        """Not bitwise: a pass when the published weights are within the tolerance of the replay's, and the
        replay goes on from the published weights (the next record starts there)."""
        pub = self.published(rec, base) if self.published is not None else None
        if pub is None or pub.content_hash != rec.checkpoint_hash:
            why = "the replay is not bitwise and the published weights could not be had"
            return self._stop(StepAudit(rec.seq, rec.version, "unavailable", rec.checkpoint_hash, self.held,
                                        why))
        c = compare(self.model.state_dict(), pub, self.tolerance, base=base)
        if not c.within:
            return self._stop(StepAudit(rec.seq, rec.version, "fail", rec.checkpoint_hash, self.held,
                                        c.reason))
        replayed, self.held = self.held, rec.checkpoint_hash
        self.model.load_state_dict(pub.to_state_dict())
        return StepAudit(rec.seq, rec.version, "pass", rec.checkpoint_hash, self.held,
                         f"within tolerance (the replay made {replayed}): {c.reason}")

    def _stop(self, result: StepAudit) -> StepAudit:
        self.stopped = f"after step {result.seq} ({result.outcome})"
        return result


def audit_window(model: torch.nn.Module, records: Sequence[StepRecord], groups_of: GroupsOf, *,
                 settings: StepSettings, opt: Optimizer | None = None, tolerance: float = 0.0,
                 published: PublishedOf | None = None) -> list[StepAudit]:
    """Audit ``records`` (consecutive steps, oldest first) on ``model``, which holds the first one's base
    policy, and ``opt`` its optimizer state (None: a fresh optimizer, for a window from version 0).
    ``settings``: the run's, from its configuration; a record naming others fails. ``tolerance`` and
    ``published``: see :class:`WindowReplay`."""
    replay = WindowReplay(model, settings, opt, tolerance=tolerance, published=published)
    return [replay.audit(rec, groups_of) for rec in records]
