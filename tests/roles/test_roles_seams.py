"""A role's tasks (``roles/common/seams.py``): loops under the node's real task supervisor, jobs in one task
group; a failing job stays alone, closing the role ends every loop and job."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import cast

import pytest

from intellect_node.node.tasks import TaskSupervisor
from intellect_node.roles.common.seams import LoopFactory, RoleTasks, Runtime
from tests.support.wait import wait_until


class _Spawner:
    """The one part of the runtime :class:`RoleTasks` uses, backed by the node's own supervisor."""

    def __init__(self) -> None:
        self.supervisor = TaskSupervisor()

    def spawn(self, name: str, factory: LoopFactory, *, essential: bool = True,
              may_end: bool = False) -> asyncio.Task[None]:
        return self.supervisor.spawn(name, factory, essential=essential, may_end=may_end)


def test_a_failing_job_stays_alone_and_close_ends_loops_and_jobs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="intellect_node.roles.common.seams")
    seen: list[str] = []

    async def main() -> None:
        tasks = RoleTasks(cast(Runtime, _Spawner()), "role")
        release = asyncio.Event()

        async def loop() -> None:
            seen.append("loop running")
            try:
                await asyncio.Event().wait()
            finally:
                seen.append("loop ended")

        async def fails() -> None:
            raise RuntimeError("a bug on one peer's batch")

        async def finishes() -> None:
            await release.wait()
            seen.append("finished")

        async def hangs() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                seen.append("hung job cancelled")

        await tasks.open()
        tasks.loop("role-loop", loop)
        tasks.job(fails(), "checking batch x")
        done = tasks.job(finishes(), "checking batch y")
        tasks.job(hangs(), "checking batch z")
        await wait_until(lambda: any("checking batch x failed" in r.message for r in caplog.records),
                         what="the failing job's log line")
        release.set()  # the failure cancelled nobody: the next job still finishes
        assert done is not None
        await done
        await wait_until(lambda: "loop running" in seen, what="the loop")
        await tasks.close()
        # close() returned only after every loop and job had ended.
        assert sorted(seen) == sorted(["finished", "loop running", "loop ended", "hung job cancelled"])
        # Closed: a job is refused and its coroutine closed unrun (no "never awaited" warning).
        late = finishes()
        assert tasks.job(late, "after close") is None
        assert inspect.getcoroutinestate(late) == inspect.CORO_CLOSED

    asyncio.run(asyncio.wait_for(main(), 30))
    failure = next(r for r in caplog.records if "checking batch x failed" in r.message)
    assert failure.exc_info is not None and "a bug on one peer's batch" in str(failure.exc_info[1])

