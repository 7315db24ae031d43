"""The validator's verdicts, out: counted, charged to their worker, reported, gossiped, logged.

:meth:`Publication.publish` takes a verdict through these steps, in this order:

1. **charge** (:meth:`Publication._charge`): the verdict is tallied (``accepted``, ``stale`` and
   ``unchecked``, ``rejected``, ...); a refusal that is the worker's fault is recorded against it in the
   peerbook and in its record here (``reputation.py``: a strike for ``future`` and ``unavailable``, a
   rejection for the rest), and the verdict carries ``ban`` when that banned the worker. A reason in
   ``protocol.rl.NOT_WORKERS_FAULT`` is no one's fault and charges no one;
2. **report**: the worker's notice-to-verdict latency, the status board's verdict, a log line;
3. **gossip**: sealed and published on the run's ``verdicts`` topic; an accepted verdict is kept too (the
   last :data:`RESEND_KEPT`);
4. **hops**: its line in ``validator/hops.jsonl`` (``hops.py``).

Gossip keeps nothing for a peer that is down, so accepted work would be lost to a trainer restart: when the
trainer is heard again after a silence, the validator takes the kept verdicts of that stretch
(:meth:`Publication.missed_since`) and gossips them again, dated now (:meth:`Publication.resend`; the
trainer ignores those it had).

Nothing here references the validator: it hands in the swarm, the status board, the workers' records and
the hops log.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec

from intellect_node.config.status import StatusBoard
from intellect_node.protocol.rl import NOT_WORKERS_FAULT, BatchVerdict, now_ms, seal_verdict
from intellect_node.roles.common.seams import RoleSwarm
from intellect_node.roles.validator.hops import HopsLog
from intellect_node.roles.validator.reputation import STRIKES, Reputation

log = logging.getLogger(__name__)

RESEND_KEPT = 512
"""Accepted verdicts kept for a trainer that comes back (about the batches of a few policy versions;
older ones would be stale at the trainer anyway)."""


class Publication:
    """Publishes a validator's verdicts on ``topic`` (the run's ``verdicts`` topic)."""

    def __init__(self, swarm: RoleSwarm, board: StatusBoard, reputation: Reputation, hops: HopsLog,
                 topic: str) -> None:
        self._swarm = swarm
        self._board = board
        self._reputation = reputation
        self._hops = hops
        self._topic = topic
        # Accepted verdicts, newest last, with when they were published (monotonic).
        self._accepted: deque[tuple[float, BatchVerdict]] = deque(maxlen=RESEND_KEPT)
        self.counts = {"accepted": 0, "rejected": 0, "stale": 0, "unchecked": 0, "duplicate": 0,
                       "unavailable": 0, "resent": 0}

    async def publish(self, verdict: BatchVerdict, worker: str, *, arrived: float | None = None) -> None:
        """Count, charge and gossip ``verdict`` (the steps of the module docstring); ``arrived``: when its
        notice was taken in (monotonic), None for a verdict with no notice behind it."""
        verdict = await self._charge(verdict, worker)
        self._report(verdict, worker, arrived)
        if verdict.accepted:
            self._accepted.append((time.monotonic(), verdict))
        await self._swarm.publish(self._topic, seal_verdict(self._swarm.key, verdict))
        self._hops.verdict(verdict, arrived)

    async def _charge(self, verdict: BatchVerdict, worker: str) -> BatchVerdict:
        """Tally ``verdict`` and hold a refusal against ``worker``; the verdict, with ``ban`` when that
        banned the worker."""
        reason = verdict.reason
        if verdict.accepted:
            self.counts["accepted"] += 1
            return verdict
        if reason in NOT_WORKERS_FAULT:
            self.counts["stale" if reason == "stale" else "unchecked"] += 1
            return verdict
        self._swarm.peerbook.record_rejection(worker, f"batch {verdict.batch_cid}: {reason}")
        if reason in STRIKES:
            self.counts["unavailable"] += reason == "unavailable"
            banned = self._reputation.strike(worker, reason)
        else:
            self.counts["rejected"] += 1
            self.counts["duplicate"] += reason == "duplicate"
            banned = await self._reputation.reject(worker, reason)
        return msgspec.structs.replace(verdict, ban=True) if banned else verdict

    def _report(self, verdict: BatchVerdict, worker: str, arrived: float | None) -> None:
        if arrived is not None:
            self._reputation.latency_seen(worker, time.monotonic() - arrived)
        self._board.verdict(verdict.accepted, verdict.n_accepted + verdict.n_rejected, reason=verdict.reason,
                            detail=verdict.detail, peer=worker)
        log.info("batch %s from %s v%d: %s%s", verdict.batch_cid[-8:], worker[-6:], verdict.policy_version,
                 "accepted" if verdict.accepted else f"rejected ({verdict.reason}: {verdict.detail[:80]})",
                 " -> banned" if verdict.ban else "")

    def missed_since(self, since: float) -> list[BatchVerdict]:
        """The accepted verdicts published at ``since`` (monotonic) or later, oldest first."""
        return [v for t, v in self._accepted if t >= since]

    async def resend(self, verdicts: list[BatchVerdict]) -> None:
        """Gossip accepted verdicts again for a trainer that was away (it ignores those it has)."""
        log.info("trainer heard again: re-sending %d accepted verdicts it may have missed", len(verdicts))
        self.counts["resent"] += len(verdicts)
        for v in verdicts:  # dated now: receivers act only on recent verdicts (protocol.rl)
            fresh = msgspec.structs.replace(v, time_ms=now_ms())
            await self._swarm.publish(self._topic, seal_verdict(self._swarm.key, fresh))
