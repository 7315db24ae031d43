"""Scoring processes: run a checker on hostile text under a wall-clock limit, from any thread.

math-verify and several reasoning-gym checkers call sympy, which can run for hours (or eat all memory) on
an answer such as ``9^{9^{9^{9}}}``. math-verify's own timeout is ``signal.alarm``, which works only on
the main thread, and the roles score on worker threads (``asyncio.to_thread``). So checkers run in child
processes this module owns: the caller sends ``(module, function, args)``, waits at most ``timeout_s``
for the reply, and on a timeout kills that child by its PID and starts another. Nothing in the caller's
process can hang or run out of memory because of a completion.

A child is a plain ``python -m intellect_node.envs._child`` reading length-prefixed pickled requests on
its stdin and answering length-prefixed msgpack replies of a fixed, data-only shape
(:class:`~intellect_node.envs._child.Reply`: a number or an error message, at most
:data:`~intellect_node.envs._child.MAX_REPLY_BYTES`) on its stdout: a child has run a checker on
hostile text, so what it sends back is never unpickled (not ``multiprocessing``: no re-import of the
parent's ``__main__``, no fork of a process holding libp2p and torch threads). It runs with a fixed
``PYTHONHASHSEED`` (so set iteration order in a checker is the same on every node), one BLAS thread, an
address-space limit, and a watchdog that ends it when its parent is gone. Only functions in modules
under ``intellect_node.envs`` may be called, and they must return a number.

Modules a checker needs are imported once per child before the first timed call (``warm``), so the time
limit measures the checker and not an import of sympy. Overhead per call on an idle 2-core machine: see
``bench/reward_scoring.py`` (a pipe round trip, a pickle and a msgpack reply, well under a millisecond).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from intellect_node.envs import _child

log = logging.getLogger(__name__)

class ScoringFailed(Exception):
    """A checker could not score an answer (timed out, crashed on it); ``reason`` is a short code.

    Raised by checkers that run outside this process (this module); ``Problem.judge``
    turns it into a reward of 0 with that reason, so it never reaches a role."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock limit for one scoring call (math-verify's own default is 5 s per parse and per compare).
Rewards near the limit can differ between a fast and a slow node, so keep it well above what an honest
answer needs; ``rl.reward_timeout_s`` sets it."""

START_TIMEOUT_S = 120.0
"""How long a new child may take to start and import its checker's modules (sympy, reasoning-gym: about
2 s on an idle machine, far more on a loaded one). Not part of any call's time limit."""

MEMORY_LIMIT_BYTES = 4 << 30
"""Address-space limit of a child (RLIMIT_AS): a checker that tries to build an astronomically large
number fails with MemoryError (reward 0, ``checker_error``) instead of pushing the node into swap."""

_HEADER = struct.Struct(">I")


class _Child:
    """One scoring process and the modules it has imported."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env[_child.MEMORY_ENV] = str(MEMORY_LIMIT_BYTES)
        self.proc = subprocess.Popen([sys.executable, "-m", "intellect_node.envs._child", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     close_fds=True)
        self.imported: set[str] = set()

    def call(self, request: tuple[str, str, tuple[Any, ...]], timeout_s: float) -> Any:
        """Send one request and wait for its reply; ``TimeoutError`` when none comes in ``timeout_s``."""
        assert self.proc.stdin is not None
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ChildGone(f"scoring process ended ({exc})") from exc
        deadline = time.monotonic() + timeout_s
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if size > _child.MAX_REPLY_BYTES:
            raise ChildGone(f"scoring process sent a {size}-byte reply")
        try:
            reply = _child.decode_reply(self._read(size, deadline))
        except ValueError as exc:
            raise ChildGone(f"scoring process broke the reply format: {exc}") from None
        if reply.ok:
            return reply.value
        raise ScoringFailed("checker_error", reply.error[:200])

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise ChildGone(f"scoring process exited ({self.proc.poll()})")
            buf += chunk
        return bytes(buf)

    def kill(self) -> None:
        """End this child by its PID (never by name) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class ChildGone(Exception):
    """The scoring process died or broke the protocol (not the completion's fault: retried once)."""


class ScoringPool:
    """Up to ``size`` scoring processes shared by every thread of this process.

    ``call(module, function, *args, timeout_s=)`` returns what ``module.function(*args)`` returned in a
    child, or raises :class:`ScoringFailed` with reason ``timeout`` (the child was killed; a fresh one
    takes its place on the next call) or ``checker_error`` (the function raised there).
    """

    def __init__(self, size: int = 2) -> None:
        if size < 1:
            raise ValueError("a scoring pool needs at least one process")
        self.size = size
        self._idle: list[_Child] = []
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0
        self.killed = 0

    def call(self, module: str, function: str, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
             warm: tuple[str, ...] = ()) -> Any:
        if not module.startswith("intellect_node.envs."):
            raise ValueError(f"scoring processes run only intellect_node.envs functions, not {module}")
        with self._slots:
            for attempt in (0, 1):
                child = self._take()
                try:
                    self._warm(child, (module, *warm))
                    value = child.call((module, function, args), timeout_s)
                except TimeoutError:
                    self._discard(child)
                    raise ScoringFailed("timeout", f"{module}.{function} ran past {timeout_s:g} s") from None
                except ChildGone as exc:
                    self._discard(child)
                    if attempt:
                        raise ScoringFailed("checker_error", str(exc)) from None
                    log.warning("scoring process lost (%s); starting another", exc)
                    continue
                except ScoringFailed:
                    self._give_back(child)  # the function raised in the child: the child itself is fine
                    raise
                except BaseException:
                    self._discard(child)  # a reply may be left unread: never reuse this child
                    raise
                self._give_back(child)
                return value
        raise AssertionError("unreachable")

    @staticmethod
    def _warm(child: _Child, modules: tuple[str, ...]) -> None:
        for mod in modules:
            if mod not in child.imported:
                try:
                    child.call(("", "import", (mod,)), START_TIMEOUT_S)
                except TimeoutError:
                    raise ChildGone(f"scoring process took over {START_TIMEOUT_S:g} s to import {mod}") \
                        from None
                child.imported.add(mod)

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise ScoringFailed("checker_error", "scoring pool closed")
            while self._idle:
                child = self._idle.pop()
                if child.proc.poll() is None:
                    return child
                child.kill()
            self.started += 1
        return _spawner().submit(_Child).result()

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if self._closed:
                child.kill()
            else:
                self._idle.append(child)

    def _discard(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self.killed += 1

    def close(self) -> None:
        """Kill the idle children (a call in flight kills its own when it returns)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


_SPAWNER: ThreadPoolExecutor | None = None


def _spawner() -> ThreadPoolExecutor:
    """The one thread that starts scoring processes. A child asks Linux to kill it when its parent dies
    (``PR_SET_PDEATHSIG``), and Linux does so when the *thread* that started it ends: starting children
    from a caller's thread (``asyncio.to_thread``, a test's thread) would kill them with it. This thread
    lives as long as the process."""
    global _SPAWNER
    with _DEFAULT_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="scoring-spawn")
        return _SPAWNER


_DEFAULT: ScoringPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> ScoringPool:
    """The process-wide pool the checkers use (closed at exit)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ScoringPool()
            atexit.register(_DEFAULT.close)
        return _DEFAULT
