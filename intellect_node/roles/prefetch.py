"""The trainer's prefetch: a batch named by a worker's notice is fetched and decoded while its validators
verify it, so the verdict only has to release it (``roles/trainer.py``).

Without it the trainer fetched a batch after its verdict: one more round trip to the worker (manifest,
chunk) and a decode on the path from a worker's batch to the trainer's step. Notices are unverified
input from any peer, so what a notice can make the trainer do is bounded: only notices of versions the
trainer would still train on, at most :data:`PER_WORKER` batches held per worker, :data:`LIMIT` in all
(the oldest forgotten first), :data:`CONCURRENT` fetches at once, nothing kept past :data:`TTL_S`. A
prefetch that fails is forgotten quietly (the verdict path fetches again and the validators judge the
worker); nothing a prefetch finds is trusted before the verdict: the trainer checks the batch against
its verdict and re-scores every rollout as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from intellect_node.errors import IntellectNodeError
from intellect_node.protocol.rollout import RolloutBatch

log = logging.getLogger(__name__)

LIMIT = 32
"""Batches held or in flight at once (a few steps' worth: 8 groups a step are 2 batches of 4)."""
PER_WORKER = 4
"""Batches held per worker (a worker submits ``batches_per_version`` per version, 2-4 in practice)."""
CONCURRENT = 2
TTL_S = 120.0
"""A batch whose verdict has not come by then is dropped (validators answer in seconds)."""

Fetch = Callable[[str, str, int], Awaitable[tuple[bytes, RolloutBatch]]]
"""(worker, batch CID, announced size) -> the blob's bytes and the batch decoded from them."""


@dataclass
class Prefetched:
    worker: str
    cid: str
    version: int
    task: asyncio.Task[tuple[bytes, RolloutBatch, float] | None]
    started: float


class Prefetch:
    """Batches fetched ahead of their verdicts, keyed by (worker, CID)."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._held: OrderedDict[tuple[str, str], Prefetched] = OrderedDict()
        self._slots = asyncio.Semaphore(CONCURRENT)
        self.counts = {"started": 0, "used": 0, "unused": 0, "failed": 0}

    def offer(self, worker: str, cid: str, version: int, size: int, floor: int, newest: int) -> bool:
        """A notice heard: start fetching its batch if the bounds allow; True when started."""
        now = time.monotonic()
        self._expire(now, floor)
        key = (worker, cid)
        if key in self._held or not floor <= version <= newest:
            return False
        if sum(1 for w, _ in self._held if w == worker) >= PER_WORKER:
            return False
        while len(self._held) >= LIMIT:
            self._forget(next(iter(self._held)))
        task = asyncio.get_running_loop().create_task(self._run(worker, cid, size))
        self._held[key] = Prefetched(worker, cid, version, task, now)
        self.counts["started"] += 1
        return True

    async def _run(self, worker: str, cid: str, size: int) -> tuple[bytes, RolloutBatch, float] | None:
        async with self._slots:
            try:
                data, batch = await self._fetch(worker, cid, size)
            except asyncio.CancelledError:
                raise
            except (IntellectNodeError, asyncio.TimeoutError, OSError) as exc:
                self.counts["failed"] += 1
                log.debug("prefetch of %s from %s failed: %s", cid, worker, exc)
                return None
        return data, batch, time.time()  # wall clock: a hop timestamp (metrics.jsonl)

    async def claim(self, worker: str, cid: str, *,
                    wait: bool = True) -> tuple[bytes, RolloutBatch, float] | None:
        """The prefetched batch (waiting for a fetch under way, unless ``wait`` is False: the worker was
        banned meanwhile, so a fetch from it will not finish and the caller asks the validator) and when
        it arrived; None when there is none or it failed. A claimed batch leaves the prefetch."""
        held = self._held.pop((worker, cid), None)
        if held is None:
            return None
        if not wait and not held.task.done():
            held.task.cancel()
            self.counts["unused"] += 1
            return None
        got = await held.task
        if got is not None:
            self.counts["used"] += 1
        return got

    def _expire(self, now: float, floor: int) -> None:
        for key, p in list(self._held.items()):
            if p.version < floor or now - p.started > TTL_S:
                self._forget(key)

    def _forget(self, key: tuple[str, str]) -> None:
        p = self._held.pop(key)
        self.counts["unused"] += 1
        p.task.cancel()

    def close(self) -> None:
        for key in list(self._held):
            self._forget(key)
