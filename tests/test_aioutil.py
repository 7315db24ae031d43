"""``cancel_and_wait``: every close path's way to end its tasks, robust to a lost cancel."""

from __future__ import annotations

import asyncio
import logging

import pytest

from intellect_node.aioutil import cancel_and_wait


async def _drops_cancels(n: int, dropped: list[int]) -> None:
    """Waits for ever, swallowing its first ``n`` cancels (what a lost cancel looks like from outside:
    Python 3.11's ``wait_for`` returning its inner result as the cancel lands)."""
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if len(dropped) >= n:
                raise
            dropped.append(1)


def test_tasks_that_lose_cancels_still_end(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        dropped: list[int] = []
        stubborn = asyncio.create_task(_drops_cancels(3, dropped), name="stubborn")
        plain = asyncio.create_task(asyncio.Event().wait())
        await asyncio.sleep(0)  # both are waiting
        with caplog.at_level(logging.WARNING, logger="intellect_node.aioutil"):
            await asyncio.wait_for(cancel_and_wait([stubborn, plain], resend_s=0.02, warn_after_s=0.03), 30)
        assert stubborn.cancelled() and plain.cancelled() and len(dropped) == 3

    asyncio.run(main())
    stuck = [r for r in caplog.records if "stubborn" in r.getMessage()]
    assert len(stuck) == 1 and "_drops_cancels" in stuck[0].getMessage()  # once, with where it waits


def test_finished_and_failed_tasks_are_collected_without_noise() -> None:
    async def boom() -> None:
        raise RuntimeError("a closing task's error")

    async def main() -> None:
        failed = asyncio.create_task(boom())
        done = asyncio.create_task(asyncio.sleep(0))
        await asyncio.sleep(0.01)
        await cancel_and_wait([failed, done])
        await cancel_and_wait([])
        assert failed.done() and done.done()

    loop_errors: list[dict[str, object]] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        await main()

    asyncio.run(run())
    assert not loop_errors  # the failed task's exception was retrieved, not reported as lost
