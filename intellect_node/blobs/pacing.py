"""A seed's turns: the sends of chunks it is asked for ``X-Blob-If-Idle`` start one at a time.

Used by the bulk routes (``blobs/http.py``); measured in bench/README.md, "broadcast" (second pass).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

MAX_TURN_S = 2.0
"""The longest one send holds a seed's turn: a receiver that stops reading (frozen, or on a slow link)
delays the next send by at most this much, and before any send was measured a turn lasts this long
or until its send ends."""


class SeedPacer:
    """Turns for the sends a seed is asked for (``X-Blob-If-Idle``): one starts at a time, and a send
    holds its turn for as long as it would take alone at the fastest rate this node has sent at, or
    until it ends if sooner.

    Why: when a blob is new, every peer asks the origin at once and nobody else holds anything. Sent
    side by side, 8 first chunks shared the uplink and landed together after 8 chunk times, while the
    peers' links idled (bench/README.md, "broadcast": first chunks at 0.8-3.2 s). One at a time, the
    first lands after one chunk time and its receiver serves it on while the origin sends the next.
    Later, a send slowed by its receiver's busy downlink gives up its turn after that solo time, so
    more sends overlap and the uplink stays full: turns start at most at the link's rate, never slower
    than the link can carry them. A turn never lasts more than :data:`MAX_TURN_S`.
    Waiting is bounded (``max_wait_s``, ``max_waiting``, and ``max_per_asker`` waiting requests from
    one address, so one peer cannot fill the queue); past any of them the asker is answered busy.
    """

    def __init__(self, *, slots: int = 1, max_wait_s: float = 5.0, max_waiting: int = 64,
                 max_per_asker: int = 4, max_turn_s: float = MAX_TURN_S) -> None:
        self.slots, self.max_wait_s, self.max_waiting = slots, max_wait_s, max_waiting
        self.max_per_asker, self.max_turn_s = max_per_asker, max_turn_s
        self._waiting_by: dict[str, int] = {}  # asker address -> its requests waiting now
        self.held = 0
        self.best_rate = 0.0  # bytes/s of the fastest paced send so far
        self.waited_s = 0.0  # summed time askers spent waiting for a turn (status, benchmarks)
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def turn(self, asker: str = "") -> "Turn | None":
        """Wait for a turn; None when it would take too long (answer busy)."""
        if self.held < self.slots and not self._waiters:
            self.held += 1
            return Turn(self)
        mine = self._waiting_by.get(asker, 0)
        if len(self._waiters) >= self.max_waiting or mine >= self.max_per_asker:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._waiting_by[asker] = mine + 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.max_wait_s):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self._release()  # handed a turn in the same moment: pass it on
            else:
                fut.cancel()
            if isinstance(exc, TimeoutError):
                return None
            raise
        finally:
            self.waited_s += time.monotonic() - t0
            if (left := self._waiting_by[asker] - 1) > 0:
                self._waiting_by[asker] = left
            else:
                del self._waiting_by[asker]
        return Turn(self)

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the turn passes on; ``held`` stays
                return
        self.held -= 1


class Turn:
    """One send's turn: ``start(size)`` when its bytes begin to go out, ``end(size, ok)`` when they are
    out (a successful send updates the pacer's fastest rate), ``release()`` to pass it on early. The
    turn passes on once, whichever comes first: the end, the solo-time timer or ``max_turn_s``."""

    __slots__ = ("_pacer", "_done", "_timer", "_t0")

    def __init__(self, pacer: SeedPacer) -> None:
        self._pacer, self._done = pacer, False
        # Released at the latest after max_turn_s even if the response is never sent.
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(pacer.max_turn_s,
                                                                                         self.release)
        self._t0 = 0.0

    def start(self, size: int) -> None:
        self._t0 = time.monotonic()
        if self._timer is not None:
            self._timer.cancel()
        rate = self._pacer.best_rate
        hold = min(self._pacer.max_turn_s, size / rate) if rate > 0 else self._pacer.max_turn_s
        self._timer = asyncio.get_running_loop().call_later(hold, self.release)

    def end(self, size: int, ok: bool) -> None:
        if ok and self._t0 and (dt := time.monotonic() - self._t0) > 0:
            self._pacer.best_rate = max(self._pacer.best_rate, size / dt)
        self.release()

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._done:
            self._done = True
            self._pacer._release()
