"""When a worker makes its next batch: never more than the trainer will take, never idle while it waits.

A worker holds a *credit* of batches it may still submit. It starts at the cap, ``batches_per_version x
(1 + work_ahead)``, and each batch submitted spends one. Credit comes back only on evidence that the
trainer wants more work, never on a timer while the swarm is healthy:

- **The policy moved**: each new version adds ``batches_per_version`` (versions this worker missed count
  too, so a worker that fell behind makes up its share on the newest one), up to the cap.
- **A step consumed its batches without training** (every group's rewards equal): the trainer's signed
  step record names them, and the version did not move, so without this the worker would wait for a
  version that needs its rollouts to exist. One credit per batch of its own the record names.
- **A validator could not judge a batch** (``protocol.rl.NOT_WORKERS_FAULT`` but ``stale``: it lacked
  the policy, or its reward checker ran out of time): one credit, so the step it was meant for still gets
  its groups. A stale verdict gives nothing: the version that made it stale already gave its credit. A
  rejection for the worker's own fault gives nothing either (a worker that makes bad batches does not get
  to make them faster).

Each submitted batch is remembered until one of those resolves it, so a record or verdict heard twice
(gossip redelivers, a trainer replays a journaled step) refills once.

One fallback remains for what no message can say: the trainer is waiting for groups that will never come
(another worker of the step died, a record was lost). A worker capped for :meth:`Pacing.stall_after_s`
with nothing heard, at least :data:`STALL_FLOOR_S` and :data:`STALL_FACTOR` times the usual interval
between versions, makes one batch and counts it (``stall_batches`` in its status). In a healthy run it
never fires: the interval it waits is several steps long.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable

from intellect_node.protocol.rl import NOT_WORKERS_FAULT
from intellect_node.protocol.steps import StepRecord
from intellect_node.roles.common.seen import BoundedMap

STALL_FLOOR_S = 30.0
"""The shortest wait before a capped worker that heard nothing makes one more batch."""
STALL_FACTOR = 3.0
"""The stall fallback waits this many times the median interval between the versions it heard."""
REFILL_REASONS = NOT_WORKERS_FAULT - {"stale"}
"""Verdict reasons that give a worker its batch back (module docstring)."""
PENDING_LIMIT = 4096


class Pacing:
    """The credit of one worker (module docstring). ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, per_version: int, work_ahead: int, *, async_level: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_version = per_version
        self.async_level = async_level
        self.cap = per_version * (1 + work_ahead)
        self.credit = self.cap
        self.version = -1  # the version the credit is counted at (-1: none held yet)
        self._clock = clock
        self._last_news = clock()  # the last version, refill or submission: what the stall waits from
        self._version_times: deque[float] = deque(maxlen=9)
        self._pending: BoundedMap[str, int] = BoundedMap(PENDING_LIMIT)  # submitted, not yet resolved
        self.refilled = {"no_signal": 0, "unjudged": 0}
        self.stall_batches = 0

    # -- what the worker did ---------------------------------------------------------------------

    def on_version(self, version: int) -> None:
        """The worker now generates at ``version``."""
        if version == self.version:
            return
        if self.version >= 0:  # the first version: the credit is the whole cap already
            self.credit = min(self.cap, self.credit + self.per_version * max(version - self.version, 1))
        self.version = version
        # a batch older than the async level is refused as stale: nothing will resolve it any more
        for cid, v in self._pending.items():
            if v < version - self.async_level:
                self._pending.pop(cid)
        now = self._clock()
        self._version_times.append(now)
        self._last_news = now

    def submitted(self, cid: str, version: int) -> None:
        self.credit = max(self.credit - 1, 0)
        self._pending.put(cid, version)
        self._last_news = self._clock()

    def exhausted(self) -> None:
        """Every assignment window of the version is made: nothing more until the next version."""
        self.credit = 0
        self._last_news = self._clock()

    # -- what the trainer and validators said ----------------------------------------------------

    def on_record(self, rec: StepRecord, worker: str) -> int:
        """A step record of the run's trainer: the credits it gives back (module docstring)."""
        named = [(b.cid, b.worker) for b in (*rec.batches, *rec.stale)]
        named += [(d.cid, d.worker) for d in rec.dropped]
        mine = [cid for cid, w in named if w == worker]
        resolved = [c for c in mine if self._pending.pop(c) is not None]
        if rec.trained or not resolved:
            return 0
        self.refilled["no_signal"] += len(resolved)
        return self._refill(len(resolved))

    def on_refusal(self, cid: str, reason: str) -> int:
        """A validator's rejecting verdict on one of this worker's batches."""
        if self._pending.pop(cid) is None or reason not in REFILL_REASONS:
            return 0
        self.refilled["unjudged"] += 1
        return self._refill(1)

    def _refill(self, n: int) -> int:
        given = min(n, self.cap - self.credit)
        self.credit += given
        self._last_news = self._clock()
        return given

    # -- the decision ----------------------------------------------------------------------------

    @property
    def stall_after_s(self) -> float:
        times = list(self._version_times)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return max(STALL_FLOOR_S, STALL_FACTOR * statistics.median(gaps)) if gaps else STALL_FLOOR_S

    def may_make(self) -> bool:
        """Whether the worker makes a batch now. A stall (module docstring) grants one credit."""
        if self.credit > 0:
            return True
        if self._clock() - self._last_news < self.stall_after_s:
            return False
        self.stall_batches += 1
        self.credit = 1
        return True

    def status(self) -> dict[str, int]:
        return {"credit": self.credit, "cap": self.cap, "pending": len(self._pending),
                "refilled_no_signal": self.refilled["no_signal"],
                "refilled_unjudged": self.refilled["unjudged"],
                "stall_batches": self.stall_batches}
