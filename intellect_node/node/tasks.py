"""Essential asyncio tasks of a node: :class:`TaskSupervisor` (one per runtime, ``runtime.spawn``).

Every long-lived asyncio loop of a node runs under it. A loop that raises, or returns when it should not,
is logged with its traceback and started again after a back-off; more than :data:`TASK_MAX_FAILURES`
failures within :data:`TASK_FAILURE_WINDOW_S` is fatal (the runtime exits with
:data:`~intellect_node.p2p.liveness.EXIT_UNHEALTHY`). Restarting a loop assumes its state lives on its
object and a fresh coroutine can pick it up (true of the role loops: each turn starts from the object's
queues). What it does is reported to listeners that the runtime turns into the status board's
``degraded`` reasons and the systemd watchdog (``node/sdnotify.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from intellect_node.aioutil import cancel_and_wait
from intellect_node.p2p.bridge import describe

log = logging.getLogger(__name__)

TASK_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)
"""Waits before an essential task is started again, by the number of recent failures."""
TASK_MAX_FAILURES = 5
"""Failures of one task within :data:`TASK_FAILURE_WINDOW_S` that are tolerated; one more is fatal."""
TASK_FAILURE_WINDOW_S = 120.0
TASK_STABLE_S = 5.0
"""A restarted task that keeps running this long no longer counts as restarting."""


# -- essential asyncio tasks -----------------------------------------------------------------------

TaskFactory = Callable[[], Awaitable[object]]


class TaskSupervisor:
    """Runs a node's long-lived asyncio loops; see the module docstring.

    ``on_change(name, reason)`` hears "task X restarting ..." and "" once it runs again;
    ``on_fatal(reason)`` is called once a task keeps failing."""

    def __init__(self, *, on_change: Callable[[str, str], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None, backoff: tuple[float, ...] = TASK_BACKOFF_S,
                 max_failures: int = TASK_MAX_FAILURES, window: float = TASK_FAILURE_WINDOW_S,
                 stable_after: float = TASK_STABLE_S) -> None:
        self.on_change = on_change
        self.on_fatal = on_fatal
        self.backoff = backoff
        self.max_failures = max_failures
        self.window = window
        self.stable_after = stable_after
        self.restarts = 0
        self._failing: dict[str, str] = {}
        self._tasks: dict[asyncio.Task[None], bool] = {}  # task -> essential
        self._closing = False

    def spawn(self, name: str, factory: TaskFactory, *, essential: bool = True,
              may_end: bool = False) -> asyncio.Task[None]:
        """Run ``factory()`` as task ``name``; restart it when it fails (``essential``) or only log.

        ``may_end``: returning is a normal end (a trainer loop that reached ``max_steps``), not a
        failure. Cancel the returned task to stop it (its current run is cancelled with it)."""
        task = asyncio.create_task(self._supervise(name, factory, essential, may_end), name=name)
        self._tasks[task] = essential
        task.add_done_callback(lambda t: self._tasks.pop(t, None))
        return task

    def problem(self) -> str:
        """"" while every essential task runs, else why not."""
        return next(iter(self._failing.values()), "")

    async def close(self) -> None:
        """Cancel every task still running and wait for them (the node is stopping)."""
        self._closing = True
        await cancel_and_wait(list(self._tasks))

    def begin_close(self) -> None:
        """From now on a task that ends is not restarted (services are closing what they use)."""
        self._closing = True

    def _mark(self, name: str, reason: str) -> None:
        if reason:
            self._failing[name] = reason
        elif self._failing.pop(name, None) is None:
            return
        if self.on_change is not None:
            self.on_change(name, reason)

    async def _supervise(self, name: str, factory: TaskFactory, essential: bool, may_end: bool) -> None:
        loop = asyncio.get_running_loop()
        failures: deque[float] = deque()
        while True:
            stable = loop.call_later(self.stable_after, self._mark, name, "")
            try:
                await factory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the task's edge: logged with its traceback, restarted below
                if self._closing:
                    log.debug("task %s ended while stopping: %r", name, exc)
                    return
                log.error("task %s failed", name, exc_info=True)
                why = describe(exc)
            else:
                if may_end or self._closing:
                    return
                log.error("task %s ended, but it should run until the node stops", name)
                why = "it returned"
            finally:
                stable.cancel()
            if not essential:
                return
            now = time.monotonic()
            failures.append(now)
            while failures and failures[0] < now - self.window:
                failures.popleft()
            if len(failures) > self.max_failures:
                reason = (f"task {name} failed {len(failures)} times in {self.window:.0f}s (last: {why}); "
                          "exiting")
                log.critical(reason)
                self._mark(name, reason)
                if self.on_fatal is not None:
                    self.on_fatal(reason)
                return
            delay = self.backoff[min(len(failures) - 1, len(self.backoff) - 1)]
            self.restarts += 1
            self._mark(name, f"task {name} restarting after: {why}")
            log.warning("restarting task %s in %.1fs (%d failures in %.0fs)", name, delay, len(failures),
                        self.window)
            await asyncio.sleep(delay)
