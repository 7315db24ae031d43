"""The one place where trio meets asyncio.

py-libp2p is trio-only and aiohttp is asyncio-only, so a node runs trio in one dedicated thread
(:class:`TrioThread`) beside the asyncio loop of the main thread. Crossing over:

- asyncio -> trio: :meth:`TrioThread.call` schedules a trio coroutine with
  ``TrioToken.run_sync_soon`` and awaits its result as an asyncio future. Cancelling the awaiting asyncio
  task cancels the trio task's cancel scope, so nothing keeps running for a caller that left.
- trio -> asyncio: :meth:`TrioThread.to_asyncio` uses ``loop.call_soon_threadsafe``; it never blocks the
  trio thread.

Measured with this pattern (see the libp2p notes): asyncio loop lag p99 about 30 ms, against about
60 ms for ``trio.lowlevel.start_guest_run``; hence a thread rather than guest mode.

One ``TrioThread`` can be started again after its trio run ended (the swarm restarts libp2p this way,
see ``p2p/liveness.py``). Each start is a new *run* with its own thread, token, nursery and pending
calls, so a thread that ended late (or never, when wedged and abandoned) cannot touch the state of the
run that replaced it. A run that ends without :meth:`stop` having been asked reports itself through
:attr:`TrioThread.on_exit`, and every call still waiting on it fails with ``TransportError`` instead of
hanging its caller.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, TypeVarTuple

import trio

from intellect_node.errors import TransportError

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
log = logging.getLogger(__name__)

RootFn = Callable[[trio.Nursery, "TrioThread"], Awaitable[None]]


def describe(exc: BaseException) -> str:
    """``Type: message`` of the first leaf of ``exc`` (trio and py-libp2p wrap errors in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


class _Run:
    """One ``trio.run`` of a :class:`TrioThread`."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.thread: threading.Thread | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self.ended = threading.Event()
        self.stop_requested = False
        self.error: BaseException | None = None
        self.pending: set[asyncio.Future[Any]] = set()  # touched only on the asyncio loop

    def fail_pending(self, why: str) -> None:
        """Fail every call still waiting on this run (asyncio loop only)."""
        for fut in list(self.pending):
            if not fut.done():
                fut.set_exception(TransportError(why))
        self.pending.clear()


class TrioThread:
    """Runs ``root(nursery, bridge)`` under ``trio.run`` in a daemon thread until :meth:`stop`.

    ``root`` starts its services in the nursery it is given (with ``await nursery.start(...)`` so they
    are ready before :meth:`start` returns) and returns; the thread then lives until stopped.
    """

    def __init__(self, name: str = "trio-libp2p") -> None:
        self._name = name
        self._run: _Run | None = None
        self._generation = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_exit: Callable[[str], None] | None = None
        """Called on the asyncio loop, with the reason, when a run ends that nobody asked to stop."""
        self.last_exit = ""
        """Why the latest run ended on its own ("" while it runs or after a requested stop)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "TrioThread not started"
        return self._loop

    @property
    def generation(self) -> int:
        """How many times this bridge was started (1 after the first start)."""
        return self._generation

    async def start(self, root: RootFn, timeout: float = 30.0) -> None:
        """Start a new run and wait (asyncio side) until ``root`` has returned or raised.

        The previous run, if any, must have ended or been given up with :meth:`stop`."""
        old = self._run
        if old is not None and not old.stop_requested and not old.ended.is_set():
            raise RuntimeError("the trio thread is still running; stop it first")
        self._loop = loop = asyncio.get_running_loop()
        self._generation += 1
        run = self._run = _Run(self._generation)
        self.last_exit = ""
        ready: asyncio.Future[None] = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if ready.done():
                return
            if exc is None:
                ready.set_result(None)
            else:
                ready.set_exception(exc)

        async def main() -> None:
            run.token = trio.lowlevel.current_trio_token()
            try:
                async with trio.open_nursery() as nursery:
                    run.nursery = nursery
                    try:
                        await root(nursery, self)
                    except BaseException as exc:
                        run.stop_requested = True  # start() raises it to its caller: not an on_exit
                        loop.call_soon_threadsafe(settle, exc)
                        raise
                    loop.call_soon_threadsafe(settle, None)
                    await trio.sleep_forever()
            finally:
                run.nursery = None

        def thread_main() -> None:
            try:
                trio.run(main)
            except BaseException as exc:  # the thread's edge: keep the error for whoever asks why
                run.error = exc
            finally:
                run.ended.set()
                try:
                    loop.call_soon_threadsafe(self._ended, run)
                except RuntimeError:  # the asyncio loop closed meanwhile: nobody is left to tell
                    pass

        run.thread = threading.Thread(target=thread_main, name=f"{self._name}-{run.generation}", daemon=True)
        run.thread.start()
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except asyncio.TimeoutError as exc:
            await self.astop(join_timeout=5.0)
            raise TransportError(f"libp2p services did not start within {timeout:.0f}s") from exc
        except BaseException:  # root raised, or our caller left: the caller hears of it, not on_exit
            await self.astop(join_timeout=5.0)
            raise

    def _ended(self, run: _Run) -> None:
        """On the asyncio loop, after ``run``'s thread finished."""
        why = "the libp2p thread ended" + (f": {describe(run.error)}" if run.error is not None else "")
        run.fail_pending(why)
        if run.stop_requested or run is not self._run:
            return
        if run.error is not None:
            log.error("%s", why, exc_info=(type(run.error), run.error, run.error.__traceback__))
        else:
            log.error("%s", why)
        self.last_exit = why
        if self.on_exit is not None:
            self.on_exit(why)

    @property
    def running(self) -> bool:
        run = self._run
        return run is not None and run.nursery is not None and not run.ended.is_set() \
            and not run.stop_requested

    def _current(self) -> _Run:
        run = self._run
        if run is None or run.token is None or run.ended.is_set() or run.stop_requested:
            raise TransportError("the libp2p thread is not running")
        return run

    def run_sync_soon(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """Run a plain function on the trio thread (fire and forget)."""
        run = self._current()
        assert run.token is not None
        try:
            run.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError as exc:
            raise TransportError("the libp2p thread has stopped") from exc

    def start_soon(self, fn: Callable[[*Ts], Awaitable[object]], *args: *Ts) -> None:
        """Start a background trio task in the root nursery (fire and forget; it must catch its errors,
        or it ends the run: the swarm then restarts libp2p)."""
        run = self._current()

        def spawn() -> None:
            if run.nursery is not None:
                run.nursery.start_soon(fn, *args)

        self.run_sync_soon(spawn)

    async def call(self, fn: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> T:
        """Run trio coroutine ``fn(*args)`` on the trio thread; await its result from asyncio.

        TransportError if the thread is not running or its run ends before ``fn`` answers."""
        loop = asyncio.get_running_loop()
        run = self._current()
        fut: asyncio.Future[T] = loop.create_future()
        scope_box: list[trio.CancelScope] = []

        def deliver(value: T) -> None:
            if not fut.done():
                fut.set_result(value)

        def fail(exc: BaseException) -> None:
            if not fut.done():
                fut.set_exception(exc)

        async def runner() -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                if fut.cancelled():
                    return
                try:
                    value = await fn(*args)
                except trio.Cancelled:
                    loop.call_soon_threadsafe(fail, TransportError("cancelled on the libp2p side"))
                    raise
                except Exception as exc:  # handed to the awaiting asyncio task, which decides
                    loop.call_soon_threadsafe(fail, exc)
                    return
                loop.call_soon_threadsafe(deliver, value)

        def spawn() -> None:
            if run.nursery is None:
                loop.call_soon_threadsafe(fail, TransportError("the libp2p thread has stopped"))
                return
            run.nursery.start_soon(runner)

        run.pending.add(fut)
        fut.add_done_callback(run.pending.discard)
        self.run_sync_soon(spawn)
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller left: stop the trio side too (the scope may not exist yet; runner checks fut).
            def cancel() -> None:
                for s in scope_box:
                    s.cancel()

            try:
                self.run_sync_soon(cancel)
            except TransportError:
                pass
            raise

    def to_asyncio(self, fn: Callable[[*Ts], object], *args: *Ts) -> None:
        """From the trio thread: run plain function ``fn(*args)`` on the asyncio loop, without blocking."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def stop(self, join_timeout: float = 10.0) -> bool:
        """Cancel everything on the trio side and join the thread; True if it ended within the timeout.

        A thread that does not end in time (a wedged trio loop) is left behind as a daemon thread and
        the run counts as stopped: :meth:`start` may begin a new one."""
        run = self._run
        if run is None or run.thread is None:
            return True
        run.stop_requested = True

        def cancel() -> None:
            if run.nursery is not None:
                run.nursery.cancel_scope.cancel()

        if not run.ended.is_set() and run.token is not None:
            try:
                run.token.run_sync_soon(cancel)
            except trio.RunFinishedError:
                pass
        run.thread.join(join_timeout)
        ended = not run.thread.is_alive()
        if not ended:
            log.warning("libp2p thread did not stop within %.1fs; leaving it (daemon thread)", join_timeout)
        return ended

    async def astop(self, join_timeout: float = 10.0) -> bool:
        """:meth:`stop` without blocking the asyncio loop; calls still waiting on the run fail."""
        run = self._run
        ended = await asyncio.to_thread(self.stop, join_timeout)
        if run is not None:
            run.fail_pending("the libp2p thread was stopped")
        return ended
