"""The one way tests wait: poll a condition until it holds, fail with what was awaited after a deadline.

``wait_for`` (plain code, sleeps the thread), ``wait_until`` (asyncio, sleeps the task) and ``wait_trio``
(trio, for code on a libp2p host's own thread) are the same loop: each asks a :class:`Deadline` after
every poll, so the forms cannot drift apart in what they count as success, when they give up, or what
they say when they do. Never a fixed sleep in a test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Deadline:
    """One wait's clock: ``poll`` runs the predicate once and says whether to stop, go on, or fail."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout = timeout
        self.what = what
        self.end = time.monotonic() + timeout

    def poll(self, predicate: Callable[[], T]) -> T | None:
        """The predicate's value when truthy; None while time remains; AssertionError once it has run out.

        The predicate is always asked once more after the deadline passed, so a condition that became
        true while the waiter slept counts (a loaded machine may oversleep the whole interval)."""
        value = predicate()
        if value:
            return value
        if time.monotonic() > self.end:
            raise AssertionError(f"timed out after {self.timeout}s waiting for {self.what}")
        return None


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll ``predicate`` every ``interval`` s until truthy (returned) or raise after ``timeout`` s."""
    deadline = Deadline(timeout, what)
    while (value := deadline.poll(predicate)) is None:
        time.sleep(interval)
    return value


async def _wait_async(predicate: Callable[[], T], timeout: float, interval: float, what: str,
                      sleep: Callable[[float], Awaitable[object]]) -> T:
    deadline = Deadline(timeout, what)
    while (value := deadline.poll(predicate)) is None:
        await sleep(interval)
    return value


async def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05,
                     what: str = "condition") -> T:
    """The asyncio form of :func:`wait_for`: the event loop keeps running while it waits."""
    return await _wait_async(predicate, timeout, interval, what, asyncio.sleep)


async def wait_trio(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05,
                    what: str = "condition") -> T:
    """The trio form of :func:`wait_for` (attacker hosts and other code that runs under ``trio.run``)."""
    import trio

    return await _wait_async(predicate, timeout, interval, what, trio.sleep)
