"""Liveness of the libp2p side: notice when it stops working, restart it (bounded), or give up so the
process exits non-zero and its supervisor (systemd, the demo, an operator) starts it again.

:class:`Libp2pWatch` (one per :class:`~intellect_node.p2p.swarm.Swarm`): py-libp2p runs its services
(``Swarm``, pubsub, gossipsub, Kademlia) under ``TrioManager``s. A task of one that raises makes its
manager cancel everything and raise out of ``background_trio_service``, which ends our trio thread (a
pubsub ``DecodeError`` on a malformed frame did exactly that); a service cancelled without an error ends its
manager quietly (``manager.is_finished``) while the thread and its listeners live on; and a trio loop
blocked by a runaway call answers nothing. The watch asks the trio thread every
:data:`PROBE_INTERVAL_S` which services still run (:func:`services_down`), with a deadline of
:data:`ANSWER_TIMEOUT_S`, and is woken at once when the thread ends. On a failure it stops what is left,
starts a new host on the same key and listen addresses, subscribes again (:meth:`Swarm.restart_host`),
then dials, provides and lets services re-attach in the background (:meth:`Swarm.replay`). Attempts
back off (:data:`RESTART_BACKOFF_S`); after :data:`GIVE_UP_S` without success it calls
``swarm.on_fatal`` (the runtime exits with :data:`EXIT_UNHEALTHY`). The node's asyncio loops have their
own keeper, :class:`intellect_node.node.tasks.TaskSupervisor`. Both report what they are doing (a reason
string, "" once healthy) to listeners that the runtime turns into the status board's ``degraded``
reasons, and feed the systemd watchdog (``node/sdnotify.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from intellect_node.aioutil import cancel_and_wait
from intellect_node.errors import TransportError
from intellect_node.p2p.bridge import TrioThread, describe
from intellect_node.p2p.peerbook import PeerBook

if TYPE_CHECKING:
    from intellect_node.p2p.host import P2PHost

log = logging.getLogger(__name__)

EXIT_UNHEALTHY = 75
"""Process exit code when the node could not keep itself working (sysexits' EX_TEMPFAIL: a restart may
fix it). Exit code 2 stays reserved for operator mistakes, which a restart does not fix."""

PROBE_INTERVAL_S = 1.0
"""How often the watch asks the trio thread whether the libp2p services still run."""
ANSWER_TIMEOUT_S = 8.0
"""A trio thread that does not answer a probe within this is taken as wedged. Generous on purpose (a
healthy thread answers in milliseconds; the tests wedge it with 1 s): a slow but working host on a loaded
machine must not be restarted, which would cost more than waiting. Not measured under load yet."""
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Waits between libp2p restart attempts (the last one repeats)."""
GIVE_UP_S = 20.0
"""Seconds of failed restart attempts after which the process exits with :data:`EXIT_UNHEALTHY`; with
a clean stop after it, the node is gone within 30 s of the failure."""
JOIN_OLD_THREAD_S = 3.0
"""How long a restart waits for the old trio thread to end before leaving it behind (a wedged one)."""



class Watched(Protocol):
    """What the watch uses of the swarm it keeps working (:class:`~intellect_node.p2p.swarm.Swarm`): the
    trio thread and host it probes, who was connected, and the restart, replay and give-up it drives."""

    peerbook: PeerBook

    @property
    def bridge(self) -> TrioThread: ...

    @property
    def p2p(self) -> P2PHost: ...

    def connected_peers(self) -> list[str]: ...

    async def restart_host(self, *, join_timeout: float = ...) -> None: ...

    async def replay(self, connected_before: list[str]) -> None: ...

    def fatal(self, reason: str) -> None: ...


HealthListener = Callable[[str], None]
"""Called on the asyncio loop with a reason while a part is down or restarting, "" once it works."""


async def services_down(p2p: P2PHost) -> str:
    """On the trio thread: the libp2p services of ``p2p`` whose manager no longer runs ("" if none).

    A service's manager is attached when ``background_trio_service`` starts it; ``is_running`` turns
    false once the manager finished (with or without an error)."""
    from libp2p.tools.anyio_service import LifecycleError  # libp2p is imported by now (host.py)

    services = (("swarm", p2p.host.get_network()), ("pubsub", p2p.pubsub), ("gossipsub", p2p.gossipsub),
                ("dht", p2p.dht))
    down = []
    for name, svc in services:
        try:
            running = svc.get_manager().is_running
        except LifecycleError:  # no manager attached: never started
            running = False
        if not running:
            down.append(name)
    return ", ".join(down)


class Libp2pWatch:
    """Keeps one swarm's libp2p working; see the module docstring. ``start()`` once the host is up."""

    def __init__(self, swarm: Watched, *, interval: float = PROBE_INTERVAL_S,
                 answer_timeout: float = ANSWER_TIMEOUT_S, give_up_after: float = GIVE_UP_S,
                 backoff: tuple[float, ...] = RESTART_BACKOFF_S) -> None:
        self.swarm = swarm
        self.interval = interval
        self.answer_timeout = answer_timeout
        self.give_up_after = give_up_after
        self.backoff = backoff
        self.down_reason = ""
        """Why libp2p is not working right now ("" while it is)."""
        self.restarts = 0
        """Successful restarts since the node started."""
        self.last_ok = time.monotonic()
        self.listeners: list[HealthListener] = []
        self._connected: list[str] = []  # peers connected at the last good probe: dialed after a restart
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._replay: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self.swarm.bridge.on_exit = lambda _why: self._wake.set()
        self._task = asyncio.create_task(self._loop(), name="libp2p-watch")
        self._task.add_done_callback(self._loop_ended)

    async def close(self) -> None:
        """Stop watching. The loop also checks ``_closing``: on Python 3.11 ``asyncio.wait_for`` returns
        its inner result when a cancel lands as that result arrives (a probe answering as the node
        stops), so a cancel alone could be lost and this close wait for ever (seen once in a full
        suite: a node's stop hung until the test's 280 s deadline)."""
        self._closing = True
        self._wake.set()
        # a replay started by a recovery that was under way is caught on the next pass
        while pending := [t for t in (self._task, self._replay) if t is not None and not t.done()]:
            await cancel_and_wait(pending)  # a lost cancel is sent again

    def answering(self) -> bool:
        """True while libp2p works and answered a probe recently (what the systemd watchdog needs)."""
        fresh = time.monotonic() - self.last_ok < self.answer_timeout + 2 * self.interval
        return fresh and not self.down_reason

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return
        why = f"the libp2p watch failed: {describe(exc)}"
        log.critical(why, exc_info=exc)
        self.swarm.fatal(why)

    async def _loop(self) -> None:
        while not self._closing:
            self._wake.clear()
            why = await self.check()
            if self._closing:
                return
            if why:
                if not await self._recover(why):
                    return
            else:
                self.last_ok = time.monotonic()
                self._connected = self.swarm.connected_peers() or self._connected
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    async def check(self) -> str:
        """"" if libp2p works, else why not (its thread ended, a service stopped, it does not answer)."""
        bridge = self.swarm.bridge
        if not bridge.running:
            return bridge.last_exit or "the libp2p thread is not running"
        try:
            down = await asyncio.wait_for(bridge.call(services_down, self.swarm.p2p), self.answer_timeout)
        except asyncio.TimeoutError:
            return f"the libp2p thread did not answer within {self.answer_timeout:g}s"
        except TransportError as exc:  # the run ended while we asked
            return bridge.last_exit or str(exc)
        return f"libp2p service stopped: {down}" if down else ""

    def _set(self, reason: str) -> None:
        self.down_reason = reason
        for fn in list(self.listeners):
            fn(reason)

    async def _recover(self, why: str) -> bool:
        """Restart libp2p until it works (True) or :attr:`give_up_after` passed (False, fatal called)."""
        log.error("libp2p is not working (%s); restarting it", why)
        self._set(f"libp2p restarting: {why}")
        # Dialed back afterwards: peers of the last good probe and those the peerbook still has connected.
        before = list(dict.fromkeys(self._connected + [r["peer_id"] for r in self.swarm.peerbook.snapshot()
                                                       if r["connected"]]))
        if self._replay is not None:
            self._replay.cancel()
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.swarm.restart_host(join_timeout=JOIN_OLD_THREAD_S)
                break
            except Exception as exc:  # one attempt's edge: any failure is retried, bounded below
                last = describe(exc)
                log.warning("libp2p restart attempt %d failed: %s", attempt, last)
                self._set(f"libp2p restarting: {why} (attempt {attempt} failed: {last})")
            delay = self.backoff[min(attempt - 1, len(self.backoff) - 1)]
            if time.monotonic() - t0 + delay > self.give_up_after:
                spent = time.monotonic() - t0
                reason = (f"libp2p could not be restarted ({attempt} attempts in {spent:.0f}s; "
                          f"last: {last}); exiting")
                log.critical(reason)
                self._set(reason)
                self.swarm.fatal(reason)
                return False
            await asyncio.sleep(delay)
        self.restarts += 1
        self.last_ok = time.monotonic()
        log.warning("libp2p restarted after %.1fs (%s); restarts so far: %d", time.monotonic() - t0, why,
                    self.restarts)
        self._set("")
        self._replay = asyncio.create_task(self.swarm.replay(before), name="libp2p-replay")
        return True
