"""Each worker's record at a validator: accepted work, rejections, strikes, verdict latency, and its ban.

- **Trust**: the batches of a worker accepted here. A worker with any is "proven" and served from the
  proven pool (``role.py``); its first ``rl.verify_first_batches`` are checked in full.
- **Rejections**: a refusal for what a batch holds (a bad proof, a ``duplicate``, ``not_assigned``, ...).
  At ``rl.ban_after`` of them the worker is banned here and the verdict carries ``ban``: one vote toward
  ``run.verdict_quorum`` at the trainer. The latest :data:`REASONS_KEPT` reasons are kept with the count.
- **Strikes**: refusals of a notice its sender could not back (``future``, ``unavailable``, and what the
  intake counts as one). At ``validator.strikes_ban_after`` of them the worker is banned: in the peerbook
  at once (what it sends next is dropped), then at the swarm as one of the role's jobs.
- **Latency**: the last :data:`LATENCY_KEPT` seconds from notice to verdict, for the 64 latest workers.

Every map is bounded (:data:`PEERS_KEPT` workers): many fresh keys make the oldest records go, never the
memory grow. Nothing here references the validator: it hands in the swarm, the role's tasks and what to
do when a worker is banned (forget its queue).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from intellect_node.roles.common.seams import RoleSwarm, RoleTasks
from intellect_node.roles.common.seen import BoundedMap

POOLS = ("proven", "new")
"""Workers with accepted work at this validator, and the rest: each has its own slots and scorers."""
LATENCY_KEPT = 32
"""Recent verdict latencies kept per worker (``latency_s`` in the status), for the 64 latest workers."""
PEERS_KEPT = 65536
"""Workers whose rejections, reasons and strikes are counted (what many keys can make us hold)."""
REASONS_KEPT = 16
"""Reasons kept per worker (its latest rejections)."""
STATUS_PEERS = 64
"""Workers listed per map in the status payload (the latest ones)."""
STRIKES = frozenset({"unavailable", "future"})
"""Refusals of notices the sender could not back: counted toward ``validator.strikes_ban_after``."""


class Reputation:
    """The per-worker record of one validator (see the module docstring)."""

    def __init__(self, swarm: RoleSwarm, tasks: RoleTasks, *, ban_after: int, strikes_ban_after: int,
                 on_ban: Callable[[str], object]) -> None:
        self._swarm = swarm
        self._tasks = tasks
        self._ban_after = ban_after
        self._strikes_ban_after = strikes_ban_after
        self._on_ban = on_ban
        self.trust: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)  # worker -> accepted batches
        self.rejections: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)
        self.reasons: BoundedMap[str, deque[str]] = BoundedMap(PEERS_KEPT)  # the latest REASONS_KEPT
        self.strikes: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)  # refusals come before the newcomer limit
        self.latency: BoundedMap[str, deque[float]] = BoundedMap(64)
        self.counts = {"banned": 0}

    def proven(self, worker: str) -> int:
        """The batches of ``worker`` accepted here."""
        return self.trust.get(worker) or 0

    def pool(self, worker: str) -> str:
        return "proven" if self.trust.get(worker) else "new"

    def accepted(self, worker: str) -> None:
        self.trust.put(worker, self.proven(worker) + 1)

    def strike(self, worker: str, reason: str) -> bool:
        """Count a strike; True (and the ban under way) when it reaches ``strikes_ban_after``."""
        n = (self.strikes.get(worker) or 0) + 1
        self.strikes.put(worker, n)
        if n < self._strikes_ban_after or self._swarm.is_banned(worker):
            return False
        self._swarm.peerbook.ban(worker, f"{n} strikes, last: {reason}")  # at once: drop what follows
        self._tasks.job(self.ban(worker, f"{n} strikes, last: {reason}"), f"banning {worker}")
        return True

    async def reject(self, worker: str, reason: str) -> bool:
        """Count a rejected batch; True (once the ban is done) when it reaches ``rl.ban_after``."""
        n = (self.rejections.get(worker) or 0) + 1
        self.rejections.put(worker, n)
        latest = self.reasons.get(worker) or deque(maxlen=REASONS_KEPT)
        latest.append(reason)
        self.reasons.put(worker, latest)
        banned = n >= self._ban_after and not self._swarm.is_banned(worker)
        if banned:
            await self.ban(worker, f"{n} rejected batches, last: {reason}")
        return banned

    async def ban(self, worker: str, why: str) -> None:
        self.counts["banned"] += 1
        self._on_ban(worker)
        await self._swarm.ban(worker, why)

    def latency_seen(self, worker: str, seconds: float) -> None:
        kept = self.latency.get(worker) or deque(maxlen=LATENCY_KEPT)
        kept.append(round(seconds, 3))
        self.latency.put(worker, kept)

    def status(self) -> dict[str, object]:
        return {"rejections_by_worker": dict(self.rejections.items()[-STATUS_PEERS:]),
                "reasons_by_worker": {w: list(r) for w, r in self.reasons.items()[-STATUS_PEERS:]},
                "strikes_by_worker": dict(self.strikes.items()[-STATUS_PEERS:]),
                "latency_s": {w: list(d) for w, d in self.latency.items()}}
