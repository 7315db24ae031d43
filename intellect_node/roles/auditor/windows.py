"""Audit windows: which steps an auditor replays, and where each window's replay starts.

A window is the run of steps from one start to the next checkpoint: a start is version 0 (the run's model
and a fresh optimizer, held by every node) or a step record carrying ``state`` (``protocol/steps.py``: the
trainer checkpointed after that step and published the weights and optimizer state as blobs).

:class:`WindowPlan` is the choice, a pure state machine (no I/O, no tasks): for each start it hears, in
order of sequence number, it draws once from the auditor's own randomness whether to audit the window
that begins there (probability ``validator.audit_fraction``). A drawn window is replayed record by record;
at its end (the next record with ``state``) the next window is drawn: audited, the replay simply goes on
(so at fraction 1.0 every step heard is replayed, in one replay); not audited, the auditor waits for the
next start. The draws are made when a start is heard, after the trainer signed it and every step before
it, and are never told to anyone: the trainer cannot know which of its steps will be replayed.

:func:`load_start` puts a window's start state into the model and an optimizer built from the run's
settings (the state's file holds no hyperparameters: ``trainer/optstate.py``), checking both against the
hashes the trainer signed; the weights go into the model's own tensors one at a time, from a file the
chain auditor maps (``published.fetch_mapped``), so a start costs no model-sized copy in memory.
:func:`check_end` compares, at a record carrying ``state``, the replay's
optimizer state with the one published: a trainer that publishes a state other than the one its steps
made is caught by the window before it, as a nudged weight is. Within ``run.audit_tolerance`` (a replay
that is not bitwise) the published state is fetched and its moments compared by numbers, each relative
to the replay's own norm, and the replay goes on from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from intellect_node.errors import ProtocolError
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.steps import StepRecord, StepSettings
from intellect_node.roles.auditor.replay import PublishedOf, StepAudit, WindowReplay
from intellect_node.roles.auditor.tolerance import compare
from intellect_node.trainer.optim import Optimizer
from intellect_node.trainer.optstate import encode_optimizer, load_optimizer
from intellect_node.trainer.step import make_optimizer

log = logging.getLogger(__name__)

OptimizerOf = Callable[[StepRecord], "PolicyWeights | None"]
"""The optimizer state published with a record carrying ``state``; None when it cannot be had."""

IDLE_HOLD = 64
"""Records an idle auditor keeps while no start is held (the newest): a start's window begins after it,
so older records are of use only if record 1 (version 0's window) is still on its way."""


@dataclass(frozen=True)
class Start:
    """Where a window starts: ``record`` None for version 0, else the record whose ``state`` it is; the
    window's first record is ``first``."""

    first: int
    record: StepRecord | None = None

    @property
    def version(self) -> int:
        return 0 if self.record is None else self.record.version


class WindowPlan:
    """Which records to replay (see the module docstring). ``draw``: uniform in [0, 1), secret."""

    def __init__(self, fraction: float, draw: Callable[[], float]) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"audit fraction {fraction} is not in (0, 1]")
        self.fraction = fraction
        self._draw = draw
        self.position = 1
        """The lowest sequence number still of use: records below it are neither replayed nor starts."""
        self.skipped = 0  # windows drawn and not audited
        self._from_zero = True  # version 0's window not drawn yet

    def _audit(self) -> bool:
        if self._draw() < self.fraction:
            return True
        self.skipped += 1
        return False

    def next_start(self, held: Mapping[int, StepRecord]) -> Start | None:
        """The next window to audit whose start is among ``held`` (drawing each start found once, in order
        of sequence number), or None: wait for more records. Moves :attr:`position` past every start
        drawn and not audited."""
        while True:
            if self._from_zero and self.position == 1 and 1 in held:
                start = Start(first=1)
                self._from_zero = False
            else:
                seqs = [s for s, r in held.items() if s >= self.position and r.state is not None]
                if not seqs:
                    return None
                rec = held[min(seqs)]
                start = Start(first=rec.seq + 1, record=rec)
                self._from_zero = False
            self.position = start.first
            if self._audit():
                return start

    def goes_on(self, rec: StepRecord) -> bool:
        """After ``rec`` passed and carries ``state`` (a window's end): whether the next window is audited
        too (the replay goes on); if not, the auditor waits for the next start after ``rec``."""
        self.position = rec.seq + 1
        return self._audit()

    def ended(self, seq: int) -> None:
        """A window ended at ``seq`` without passing (or a record was missing): resume the search after it."""
        self.position = max(self.position, seq + 1)

    def prune(self, held: dict[int, StepRecord]) -> None:
        """Drop held records no window can use (below :attr:`position`; while no start is held, all but
        the newest :data:`IDLE_HOLD` and record 1)."""
        for s in [s for s in held if s < self.position]:
            del held[s]
        if not any(r.state is not None for r in held.values()) and len(held) > IDLE_HOLD:
            keep = set(sorted(held)[-IDLE_HOLD:]) | {1}
            for s in [s for s in held if s not in keep]:
                del held[s]


def load_start(model: torch.nn.Module, start: StepRecord, weights: PolicyWeights, optimizer: PolicyWeights,
               settings: StepSettings, *, tolerance: float = 0.0,
               published: PublishedOf | None = None) -> WindowReplay:
    """A replay holding ``start``'s checkpoint: ``weights`` and ``optimizer`` (the blobs its ``state``
    names) loaded into ``model`` and a new optimizer with the run's ``settings``. ProtocolError when
    either is not what the record's hashes say or does not fit the model (the trainer's fault: it signed
    them). ``tolerance``, ``published``: see :class:`WindowReplay`."""
    assert start.state is not None, "a window starts at a record with state"
    if weights.content_hash != start.checkpoint_hash:
        raise ProtocolError(f"the weights blob of v{start.version} hashes to {weights.content_hash}, the "
                            f"record says {start.checkpoint_hash}")
    if optimizer.content_hash != start.state.optimizer_hash:
        raise ProtocolError(f"the optimizer blob of v{start.version} hashes to {optimizer.content_hash}, the "
                            f"record says {start.state.optimizer_hash}")
    own = model.state_dict()
    table = weights.tensors
    if set(table) != set(own) or any(table[k].shape != tuple(own[k].shape) for k in own):
        raise ProtocolError(f"the weights of v{start.version} do not fit the run's model")
    with torch.no_grad():  # tensor by tensor from the mapped file: one tensor's copy at a time
        for k, t in own.items():
            t.copy_(weights.tensor(k))
    opt: Optimizer = make_optimizer(model, settings.lr, betas=settings.betas,
                                    weight_decay=settings.weight_decay)
    load_optimizer(opt, optimizer)
    replay = WindowReplay(model, settings, opt, tolerance=tolerance, published=published)
    if replay.held != start.checkpoint_hash:  # the dtype the model holds is not the published one
        raise ProtocolError(f"the weights of v{start.version} do not load into the run's model unchanged")
    return replay


def check_end(replay: WindowReplay, rec: StepRecord, result: StepAudit,
              published_optimizer: OptimizerOf | None = None) -> StepAudit:
    """``result`` (``rec``'s audit), failed when ``rec`` passed, carries ``state`` and the replay's
    optimizer state is not the one published (``published``/``expected``: the two optimizer hashes).

    With the replay's ``tolerance`` (not bitwise), a state whose hash differs is compared instead with the
    published one (``published_optimizer``: fetched and hash-checked; None, ``unavailable``): each moment
    tensor's difference relative to the replay's own (``tolerance.compare`` from zero), and when every one
    is within the tolerance the replay goes on from the published state, as it does from the weights."""
    if result.outcome != "pass" or rec.state is None:
        return result
    mine = encode_optimizer(replay.opt) if replay.opt is not None else None
    made = mine.content_hash if mine is not None else ""
    if made == rec.state.optimizer_hash:
        return result
    if mine is not None and replay.tolerance > 0:
        return _optimizer_within(replay, rec, result, mine, published_optimizer)
    replay.stopped = f"after step {rec.seq} (fail)"
    return StepAudit(rec.seq, rec.version, "fail", rec.state.optimizer_hash, made,
                     f"the optimizer state published with v{rec.version} differs from the replayed one")


def _optimizer_within(replay: WindowReplay, rec: StepRecord, result: StepAudit, mine: PolicyWeights,
                      published_optimizer: OptimizerOf | None) -> StepAudit:
    assert rec.state is not None and replay.opt is not None
    pub = published_optimizer(rec) if published_optimizer is not None else None
    if pub is None or pub.content_hash != rec.state.optimizer_hash:
        replay.stopped = f"after step {rec.seq} (unavailable)"
        return StepAudit(rec.seq, rec.version, "unavailable", rec.state.optimizer_hash, mine.content_hash,
                         "the replayed optimizer state is not bitwise and the published one could not be had")
    own = mine.to_state_dict()
    c = compare(own, pub, replay.tolerance, base={k: torch.zeros_like(v) for k, v in own.items()})
    if not c.within:
        replay.stopped = f"after step {rec.seq} (fail)"
        w = c.worst
        assert w is not None
        return StepAudit(rec.seq, rec.version, "fail", rec.state.optimizer_hash, mine.content_hash,
                         f"the optimizer state published with v{rec.version} differs from the replayed one: "
                         f"{w.name} by {w.relative:.3g} of its norm (max |diff| {w.max_abs:.3g}); tolerance "
                         f"{replay.tolerance:.3g}")
    try:
        load_optimizer(replay.opt, pub)
    except ProtocolError as exc:  # the same names and shapes as the replay's: cannot happen after compare
        replay.stopped = f"after step {rec.seq} (fail)"
        return StepAudit(rec.seq, rec.version, "fail", rec.state.optimizer_hash, mine.content_hash, str(exc))
    w = c.worst
    worst = f"{w.name} by {w.relative:.3g} of its norm" if w is not None else "no tensors"
    return StepAudit(rec.seq, rec.version, "pass", result.published, result.expected,
                     f"{result.reason}; optimizer state within tolerance ({worst})".lstrip("; "))
