"""The trainer's prefetch (``roles/trainer/prefetch.py``): what an unverified notice can make the trainer
fetch is bounded (version window, per worker, in all), a claimed batch is handed over once, and a failed
fetch is forgotten quietly. The fetch itself is a stand-in here: the real one (``HintedFetcher``) is
exercised by the process tests, where every batch the trainer trains on went through it."""

from __future__ import annotations

import asyncio

from intellect_node.errors import TransportError
from intellect_node.protocol.rollout import RolloutBatch
from intellect_node.roles.trainer.prefetch import LIMIT, NEWCOMER_HELD, PER_WORKER, Prefetch


def test_prefetch_bounds_and_hand_over() -> None:
    async def main() -> None:
        fetched: list[tuple[str, str]] = []
        gate = asyncio.Event()

        async def fetch(worker: str, cid: str, size: int) -> tuple[bytes, RolloutBatch]:
            fetched.append((worker, cid))
            await gate.wait()
            if cid.startswith("bad"):
                raise TransportError("the worker did not serve it")
            return cid.encode(), RolloutBatch(run_id="r", policy_version=0, rollouts=[])

        pf = Prefetch(fetch)
        # Only versions the trainer would still train on: floor 3, newest 5.
        assert not pf.offer("w1", "old", 2, 10, 3, 5)
        assert not pf.offer("w1", "future", 6, 10, 3, 5)
        assert pf.offer("w1", "a", 5, 10, 3, 5)
        assert not pf.offer("w1", "a", 5, 10, 3, 5)  # the same notice again
        for i in range(PER_WORKER - 1):
            assert pf.offer("w1", f"more{i}", 4, 10, 3, 5)
        assert not pf.offer("w1", "one-too-many", 4, 10, 3, 5)  # per-worker cap
        assert pf.offer("w2", "bad", 5, 10, 3, 5)
        gate.set()
        got = await pf.claim("w1", "a")
        assert got is not None and got[0] == b"a" and got[2] is not None
        assert await pf.claim("w1", "a") is None  # handed over once
        assert await pf.claim("w2", "bad") is None and pf.counts["failed"] == 1
        assert await pf.claim("w3", "never-offered") is None
        # Workers with no used batch (w2, x...) hold at most NEWCOMER_HELD together.
        for i in range(LIMIT + 3):
            pf.offer(f"x{i}", f"c{i}", 5, 10, 3, 5)
        assert sum(p.newcomer for p in pf._held.values()) == NEWCOMER_HELD
        # In all at most LIMIT: the oldest are forgotten (their fetches cancelled) to make room.
        for i in range(LIMIT // PER_WORKER + 1):
            pf._proven[f"y{i}"] = None  # as if a batch of theirs had been used
            for j in range(PER_WORKER):
                pf.offer(f"y{i}", f"d{i}.{j}", 5, 10, 3, 5)
        assert len(pf._held) == LIMIT and await pf.claim("x0", "c0") is None
        # The floor moving past a version forgets its batches.
        pf.offer("y", "fresh", 7, 10, 6, 7)
        assert await pf.claim("w1", "more0") is None
        pf.close()
        assert not pf._held

    asyncio.run(main())


def test_a_fetch_from_a_banned_worker_is_not_waited_for() -> None:
    """The worker was banned after its batch was accepted: its fetch will not finish (its connections are
    closed), so the trainer does not wait for it and asks the validator instead."""
    async def main() -> None:
        started = asyncio.Event()

        async def fetch(worker: str, cid: str, size: int) -> tuple[bytes, RolloutBatch]:
            started.set()
            await asyncio.Event().wait()  # never served
            raise AssertionError("unreachable")

        pf = Prefetch(fetch)
        assert pf.offer("w1", "a", 5, 10, 3, 5)
        await started.wait()
        task = pf._held[("w1", "a")].task
        assert await pf.claim("w1", "a", wait=False) is None
        assert not pf._held and pf.counts["unused"] == 1
        await asyncio.sleep(0)  # let the cancellation land
        assert task.cancelled()
        pf.close()

    asyncio.run(main())
