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
limit measures the checker and not an import of sympy.

Whose answers a call scores decides where it runs and what it may cost: checkers call :func:`run_checker`,
which uses the :class:`Lane` the calling thread entered with :func:`scoring_in` (a validator gives workers
with accepted work and new keys pools of their own, and each batch a :class:`Meter`) or else the
process-wide :func:`default_pool` with no budget (workers, the trainer).

Overhead per call on an idle 2-core machine: see ``bench/reward_scoring.py`` (a pipe round trip, a pickle
and a msgpack reply, well under a millisecond).
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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
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


class Meter:
    """What one batch's answers may cost a scoring pool: ``seconds`` of scoring (the time its calls hold
    a process: the checker's run and the round trip, and the start of a process that replaces one its
    answer crashed) and ``timeouts`` calls that run into the time limit or crash the scoring process.
    Once either is spent, every further call raises :class:`ScoringFailed` with reason ``budget`` at
    once, and so does a call cut short by what is left of ``seconds``, or the timeout or crash beyond the
    allowance: the rest of the batch is not scored.

    A timeout costs its time limit plus a replacement process's start, which is charged to no one: it is
    the count of timeouts that bounds it. A crash is retried once on a fresh process while the allowance
    lasts, and that process's start is charged to the batch; past the allowance there is no retry.
    One batch is scored by one thread at a time (the verifier's)."""

    def __init__(self, seconds: float, timeouts: int) -> None:
        self.seconds = seconds
        self.timeouts = timeouts
        self.used_s = 0.0
        self.timed_out = 0
        self.crashed = 0
        self.calls = 0
        self.spent = ""
        """Why no more calls may run ("" while they may)."""

    def limit(self, timeout_s: float) -> float:
        """The time limit of the next call: ``timeout_s``, or less when less is left; ScoringFailed
        (``budget``) when nothing is."""
        left = self.seconds - self.used_s
        if not self.spent and left <= 0:
            self.spent = f"{self.used_s:.1f} s of scoring used of {self.seconds:.1f} s"
        if self.spent:
            raise ScoringFailed("budget", self.spent)
        return min(timeout_s, left)

    def charge(self, seconds: float, *, timed_out: bool = False, cut: bool = False,
               crashed: bool = False) -> None:
        """Count one call of ``seconds``; ScoringFailed (``budget``) when it was cut short by this meter
        (``cut``), or was a timeout or a crash of the scoring process (``crashed``) past the allowance
        (timeouts and crashes share it)."""
        self.calls += 1
        self.used_s += seconds
        if timed_out:
            self.timed_out += 1
        if crashed:
            self.crashed += 1
        if (timed_out or crashed) and self.timed_out + self.crashed > self.timeouts:
            what = [f"{self.timed_out} answers ran past the time limit"] if self.timed_out else []
            what += [f"{self.crashed} crashed the scoring process"] if self.crashed else []
            self.spent = f"{' and '.join(what)}, at most {self.timeouts} a batch"
        if cut and not self.spent:
            self.spent = f"{self.used_s:.1f} s of scoring used of {self.seconds:.1f} s"
        if self.spent and (cut or timed_out or crashed):
            raise ScoringFailed("budget", self.spent)


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

    def call(self, request: tuple[str, str, tuple[object, ...]], timeout_s: float) -> Any:
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
    takes its place on the next call), ``checker_error`` (the function raised there) or ``budget`` (the
    call's :class:`Meter` is spent, or this call spent it).
    """

    def __init__(self, size: int = 2) -> None:
        if size < 1:
            raise ValueError("a scoring pool needs at least one process")
        self.size = size
        self._idle: list[_Child] = []
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._closed = False
        self._busy: set[_Child] = set()
        self.started = 0
        self.killed = 0

    @property
    def busy(self) -> int:
        """Calls holding a process now."""
        with self._lock:
            return len(self._busy)

    def call(self, module: str, function: str, *args: object, timeout_s: float = DEFAULT_TIMEOUT_S,
             warm: tuple[str, ...] = (), meter: Meter | None = None) -> Any:
        """``module.function(*args)`` in a child within ``timeout_s``; ``meter``, when given, is charged
        the call's time and may cut it short or refuse it (reason ``budget``)."""
        if not module.startswith("intellect_node.envs."):
            raise ValueError(f"scoring processes run only intellect_node.envs functions, not {module}")
        if meter is not None:
            meter.limit(timeout_s)  # spent: refused before it waits for a process
        with self._slots:
            for attempt in (0, 1):
                # A first call's process start is not the answer's time; a retry's is: the answer
                # crashed the process it replaces.
                started = time.monotonic()
                child = self._take()
                t0: float | None = None
                limit = timeout_s
                try:
                    self._warm(child, (module, *warm))
                    if meter is not None:
                        limit = meter.limit(timeout_s)
                    t0 = started if attempt else time.monotonic()
                    value = child.call((module, function, args), limit)
                except TimeoutError:
                    self._discard(child)
                    if meter is not None and t0 is not None:
                        meter.charge(time.monotonic() - t0, timed_out=limit >= timeout_s,
                                     cut=limit < timeout_s)
                    raise ScoringFailed("timeout", f"{module}.{function} ran past {timeout_s:g} s") from None
                except ChildGone as exc:
                    self._discard(child)
                    if meter is not None and t0 is not None:
                        meter.charge(time.monotonic() - t0, crashed=True)  # past the allowance: no retry
                    if attempt or self._closed:
                        raise ScoringFailed("checker_error", str(exc)) from None
                    log.warning("scoring process lost (%s); starting another", exc)
                    continue
                except ScoringFailed:
                    self._give_back(child)  # the function raised in the child: the child itself is fine
                    if meter is not None and t0 is not None:
                        meter.charge(time.monotonic() - t0)
                    raise
                except BaseException:
                    self._discard(child)  # a reply may be left unread: never reuse this child
                    raise
                self._give_back(child)
                if meter is not None:
                    meter.charge(time.monotonic() - t0)
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
                    self._busy.add(child)
                    return child
                child.kill()
            self.started += 1
        child = _spawner().submit(_Child).result()
        with self._lock:
            self._busy.add(child)
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            self._busy.discard(child)
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()

    def _discard(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._busy.discard(child)
            self.killed += 1

    def close(self) -> None:
        """Kill every child: the idle ones and those of calls in flight, which then end at once
        (``checker_error``) instead of waiting out their time limit."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for child in idle:
            child.kill()
        for child in busy:
            if child.proc.poll() is None:
                child.proc.kill()  # by PID; the call in flight reaps it (kill() below) when it returns


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


@dataclass(frozen=True)
class Lane:
    """Where a thread's checker calls run and what they may cost: a pool, and a meter or none."""

    pool: ScoringPool
    meter: Meter | None = None


_LANE: ContextVar[Lane | None] = ContextVar("scoring_lane", default=None)


@contextmanager
def scoring_in(lane: Lane | None) -> Iterator[None]:
    """Run the checker calls of this block (this thread, this context) in ``lane``; None: the default
    pool without a budget."""
    token = _LANE.set(lane)
    try:
        yield
    finally:
        _LANE.reset(token)


def run_checker(module: str, function: str, *args: object, timeout_s: float = DEFAULT_TIMEOUT_S,
                warm: tuple[str, ...] = ()) -> Any:
    """What checkers call: :meth:`ScoringPool.call` in the current :class:`Lane` (:func:`scoring_in`),
    else in :func:`default_pool`."""
    lane = _LANE.get()
    if lane is None:
        return default_pool().call(module, function, *args, timeout_s=timeout_s, warm=warm)
    return lane.pool.call(module, function, *args, timeout_s=timeout_s, warm=warm, meter=lane.meter)
