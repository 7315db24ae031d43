"""The wait helpers: both forms return the first truthy value, and fail the same way at the deadline."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.wait import wait_for, wait_until


def test_both_forms_return_the_first_truthy_value() -> None:
    sync_polls, async_polls = itertools.count(), itertools.count()
    assert wait_for(lambda: next(sync_polls) >= 3 and "ready", 5, 0.001) == "ready"
    assert asyncio.run(wait_until(lambda: next(async_polls) >= 3 and "ready", 5, 0.001)) == "ready"
    assert next(sync_polls) == next(async_polls) == 4


def test_both_forms_fail_with_what_was_awaited() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0.01s waiting for the sync thing"):
        wait_for(lambda: 0, 0.01, 0.001, what="the sync thing")
    with pytest.raises(AssertionError, match=r"timed out after 0.01s waiting for the async thing"):
        asyncio.run(wait_until(lambda: None, 0.01, 0.001, what="the async thing"))


def test_the_event_loop_runs_while_waiting() -> None:
    async def main() -> object:
        seen: list[int] = []
        asyncio.get_running_loop().call_later(0.01, seen.append, 1)
        return await wait_until(lambda: seen, 5, 0.001)

    assert asyncio.run(main()) == [1]
