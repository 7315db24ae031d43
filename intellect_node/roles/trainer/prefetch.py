"""The trainer's prefetch: a batch named by a worker's notice is fetched and decoded while its validators
verify it, so the verdict only has to release it (``roles/trainer/intake.py`` holds it).

Without it the trainer fetched a batch after its verdict: one more round trip to the worker (manifest,
chunk) and a decode on the path from a worker's batch to the trainer's step. Notices are unverified
input from any peer (keys are free), so what a notice can make the trainer do is bounded:

1. only notices of versions the trainer would still train on; at most :data:`PER_WORKER` batches held
   per worker, :data:`NEWCOMER_HELD` for all workers without a used batch together ("unproven": no batch
   of theirs was claimed yet), :data:`LIMIT` in all (the oldest forgotten first); nothing past
   :data:`TTL_S`;
2. one fetch at a time per worker, :data:`CONCURRENT` at once for proven workers and
   :data:`NEWCOMER_CONCURRENT` for unproven ones, in separate pools: fresh keys cannot take the slots of
   workers whose batches were used;
3. a prefetch gives its slot up after :func:`deadline` (a provider that accepts and then trickles or
   never answers holds it that long at most);
4. a claimed batch (its verdict came) never waits behind queued prefetches: a prefetch still waiting
   for a slot is dropped and the caller fetches the batch at once, and one under way is waited for at
   most :data:`CLAIM_WAIT_S` (then the caller fetches from the worker and the validator, which holds it).

A prefetch that fails is forgotten quietly (the verdict path fetches again and the validators judge the
worker); nothing a prefetch finds is trusted before the verdict: the trainer checks the batch against
its verdict and re-scores every rollout as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from intellect_node.errors import IntellectNodeError
from intellect_node.protocol.rollout import RolloutBatch

log = logging.getLogger(__name__)

LIMIT = 32
"""Batches held or in flight at once (a few steps' worth: 8 groups a step are 2 batches of 4)."""
PER_WORKER = 4
"""Batches held per worker (a worker submits ``batches_per_version`` per version, 2-4 in practice)."""
NEWCOMER_HELD = 8
"""Batches held for unproven workers together: a stream of fresh keys cannot fill :data:`LIMIT`."""
CONCURRENT = 2
"""Prefetches under way at once for proven workers."""
NEWCOMER_CONCURRENT = 2
"""Prefetches under way at once for unproven workers (a pool of its own)."""
TTL_S = 120.0
"""A batch whose verdict has not come by then is dropped (validators answer in seconds)."""
DEADLINE_S = 5.0
PREFETCH_BYTES_PER_S = 2 << 20
"""A prefetch is given up after ``DEADLINE_S + size / PREFETCH_BYTES_PER_S`` (5 s plus half a second a
MiB, 37 s for the largest batch): a tarpit holds a slot that long at most, an honest batch of a few
hundred KiB arrives in well under a second on loopback and in a few on a slow link."""
CLAIM_WAIT_S = 3.0
"""How long a claim waits for its prefetch under way before the caller fetches the batch itself."""
MAX_PROVEN = 4096
"""Workers remembered as proven (their oldest forgotten first)."""


def deadline(size: int) -> float:
    return DEADLINE_S + size / PREFETCH_BYTES_PER_S


Fetch = Callable[[str, str, int], Awaitable[tuple[bytes, RolloutBatch]]]
"""(worker, batch CID, announced size) -> the blob's bytes and the batch decoded from them."""


@dataclass
class Prefetched:
    worker: str
    cid: str
    version: int
    size: int
    started: float
    newcomer: bool
    fetching: bool = False  # past its slot: the fetch itself is under way
    task: asyncio.Task[tuple[bytes, RolloutBatch, float] | None] = field(init=False)


@dataclass
class _Pool:
    slots: asyncio.Semaphore
    held: int = 0
    busy: set[str] = field(default_factory=set)  # workers with a fetch under way (one at a time each)


class Prefetch:
    """Batches fetched ahead of their verdicts, keyed by (worker, CID)."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._held: OrderedDict[tuple[str, str], Prefetched] = OrderedDict()
        self._proven: OrderedDict[str, None] = OrderedDict()
        self._pools = {False: _Pool(asyncio.Semaphore(CONCURRENT)),
                       True: _Pool(asyncio.Semaphore(NEWCOMER_CONCURRENT))}
        self._worker_locks: dict[str, tuple[asyncio.Lock, int]] = {}  # worker -> (lock, prefetches)
        self.counts = {"started": 0, "used": 0, "unused": 0, "failed": 0, "gave_up": 0, "refused": 0}

    def proven(self, worker: str) -> bool:
        return worker in self._proven

    def offer(self, worker: str, cid: str, version: int, size: int, floor: int, newest: int) -> bool:
        """A notice heard: start fetching its batch if the bounds allow; True when started."""
        now = time.monotonic()
        self._expire(now, floor)
        key = (worker, cid)
        if key in self._held or not floor <= version <= newest:
            return False
        newcomer = not self.proven(worker)
        if sum(1 for w, _ in self._held if w == worker) >= PER_WORKER \
                or (newcomer and self._pools[True].held >= NEWCOMER_HELD):
            self.counts["refused"] += 1
            return False
        while len(self._held) >= LIMIT:
            self._forget(next(iter(self._held)))
        held = Prefetched(worker, cid, version, size, now, newcomer)
        held.task = asyncio.get_running_loop().create_task(self._run(held))
        self._held[key] = held
        self._pools[newcomer].held += 1
        self.counts["started"] += 1
        return True

    async def _run(self, held: Prefetched) -> tuple[bytes, RolloutBatch, float] | None:
        pool = self._pools[held.newcomer]
        lock, users = self._worker_locks.get(held.worker, (asyncio.Lock(), 0))
        self._worker_locks[held.worker] = (lock, users + 1)
        try:
            async with lock, pool.slots:  # one fetch per worker, then a slot of its pool
                held.fetching = True
                try:
                    async with asyncio.timeout(deadline(held.size)):
                        data, batch = await self._fetch(held.worker, held.cid, held.size)
                except TimeoutError:
                    self.counts["gave_up"] += 1
                    log.debug("prefetch of %s from %s gave up after %.0f s", held.cid, held.worker,
                              deadline(held.size))
                    return None
                except (IntellectNodeError, OSError) as exc:
                    self.counts["failed"] += 1
                    log.debug("prefetch of %s from %s failed: %s", held.cid, held.worker, exc)
                    return None
        finally:
            lock, users = self._worker_locks[held.worker]
            if users > 1:
                self._worker_locks[held.worker] = (lock, users - 1)
            else:
                del self._worker_locks[held.worker]
        return data, batch, time.time()  # wall clock: a hop timestamp (metrics.jsonl)

    async def claim(self, worker: str, cid: str, *,
                    wait: bool = True) -> tuple[bytes, RolloutBatch, float] | None:
        """The prefetched batch and when it arrived; None when there is none, it failed, or it is not
        worth waiting for (then the caller fetches the batch itself, at once): a prefetch still waiting
        for a slot is dropped, one under way is waited for up to :data:`CLAIM_WAIT_S`, and none at all
        without ``wait`` (the worker was banned meanwhile: a fetch from it will not finish, the caller
        asks the validator). A claimed batch leaves the prefetch; a used one proves its worker."""
        held = self._held.pop((worker, cid), None)
        if held is None:
            return None
        self._pools[held.newcomer].held -= 1
        if not held.task.done():
            if wait and not held.fetching:
                await asyncio.sleep(0)  # one turn: a prefetch not yet run takes a free slot now
            if wait and held.fetching:
                await asyncio.wait({held.task}, timeout=CLAIM_WAIT_S)
            if not held.task.done():
                held.task.cancel()
                self.counts["unused"] += 1
                return None
        got = held.task.result() if not held.task.cancelled() else None
        if got is not None:
            self.counts["used"] += 1
            self._proven[worker] = None
            self._proven.move_to_end(worker)
            while len(self._proven) > MAX_PROVEN:
                self._proven.popitem(last=False)
        return got

    def _expire(self, now: float, floor: int) -> None:
        for key, p in list(self._held.items()):
            if p.version < floor or now - p.started > TTL_S:
                self._forget(key)

    def _forget(self, key: tuple[str, str]) -> None:
        p = self._held.pop(key)
        self._pools[p.newcomer].held -= 1
        self.counts["unused"] += 1
        p.task.cancel()

    def close(self) -> None:
        for key in list(self._held):
            self._forget(key)
