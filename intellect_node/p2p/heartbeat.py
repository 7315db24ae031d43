"""Heartbeats: each node announces itself every ``interval`` s; silent peers are marked gone.

A heartbeat is a signed :class:`~intellect_node.protocol.gossip.Heartbeat` on
``/intellect/<run>/heartbeat/1`` carrying the sender's HTTP URL, listen addresses and roles (so
providers resolve to URLs without a round trip). Liveness follows heartbeats, not connections, because
a frozen (SIGSTOPped) peer keeps its TCP connection (notes).

Every heartbeat reaches every node, so if every node beat every ``interval`` s each would receive
N / interval heartbeats a second: the idle cost of a node would grow with the swarm. So a
node stretches its interval with the swarm: it counts the alive peers that stretch too (``n``, itself
included) and beats every ``interval * n / stretch_above`` s once ``n`` passes ``stretch_above``
(at most ``max_interval``), see :func:`stretched_interval`. Every node then receives about
``stretch_above / interval`` heartbeats a second from stretching peers whatever N is (2/s with the
defaults 10 and 5 s), up to ``stretch_above * max_interval / interval`` nodes (7200), past which the
rate grows again by N / max_interval. The run's trainer and validators (and a sweep coordinator,
:data:`FIXED_RATE_ROLES`) never stretch: they are few and every node needs to know they are there soon.

A stretched heartbeat announces its interval (``interval_ms``) and receivers time that sender out after
``peer_timeout`` scaled by the same factor (:func:`timeout_for`: ``peer_timeout / interval`` of its
intervals, 4 with the defaults, counting at most ``max_interval``). A peer that announces nothing (an
unstretched or an older node) is gone after ``peer_timeout``. The sweep runs every
``min(interval, peer_timeout / 4)`` s, so a dead or frozen peer is marked gone at most its timeout plus
one sweep period after its last heartbeat: ``peer_timeout + period`` for the trainer, validators and
any node of a swarm of up to ``stretch_above`` nodes, ``peer_timeout * max_interval / interval + period``
at worst (four hours with the defaults, reached only in swarms of thousands).

The count is a local estimate (alive peers in the peerbook), so a node that just joined beats at the
base interval until it has heard the swarm (at most one ``max_interval``); a peer that lies about its
roles or ignores the rule only costs what one misbehaving publisher costs (gossipsub's rate limits and
scoring, ``p2p/host.py``), and fake peer IDs that inflate the estimate are bounded by ``max_interval``.

Replays: a heartbeat stamped more than five minutes from the receiver's clock, or one that is not newer
than the last one taken from its signer (neither a later stamp nor a higher ``seq``: a copy, or an
older one), is ignored (``MessageIgnored``, counted in ``ignored``): not forwarded, blamed on no one,
since anyone can publish a peer's old heartbeat again. A restarted node (``seq`` from 1, later stamp) and
a clock stepped back (earlier stamp, higher ``seq``) are still heard; a node restarted with its clock set
back (lower ``seq`` and stamp both) is unheard until one of them passes its last heartbeat's.

Both loops run under the runtime's task supervisor (``spawn``, see ``p2p/liveness.py``). While the
swarm restarts libp2p a failed heartbeat is not logged (the swarm logs the outage once) rather than
every interval.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import msgspec

from intellect_node.aioutil import cancel_and_wait
from intellect_node.errors import MessageIgnored, ProtocolError, TransportError
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol import gossip
from intellect_node.protocol.topics import topic

log = logging.getLogger(__name__)

FIXED_RATE_ROLES = frozenset({"trainer", "validator", "sweep-coordinator"})
"""Nodes announcing one of these roles beat at the base interval and are not counted by the stretch."""
DEFAULT_STRETCH_ABOVE = 10
DEFAULT_MAX_INTERVAL_S = 3600.0
MAX_GROWTH = 2.0
"""A node's interval at most doubles from one heartbeat to the next. A receiver that missed the heartbeat
announcing a longer interval still holds the previous promise: the next heartbeat then comes
``(1 + MAX_GROWTH)`` previous intervals after the last one it got, inside its timeout as long as
``peer_timeout`` is at least three intervals (the default is four). Shrinking is always safe."""
JITTER = 0.1
"""A node sleeps up to this fraction less than the interval it announced (never more), so nodes that
started together do not beat together."""
MAX_LATEST = 4096
"""Signers whose last heartbeat (``seq``, stamp) is remembered to ignore repeats (the peerbook's bound);
past it the longest-silent is forgotten, and a repeat of its heartbeat is taken once more: harmless."""

PeerListener = Callable[[str], None]
Spawn = Callable[[str, Callable[[], Awaitable[object]]], "asyncio.Task[None]"]


def _plain_spawn(name: str, factory: Callable[[], Awaitable[object]]) -> asyncio.Task[None]:
    """Without a runtime (tests of the swarm alone): a plain task, not restarted."""

    async def run() -> None:
        await factory()

    return asyncio.ensure_future(run())


def stretched_interval(base: float, peers: int, *, stretch_above: int, max_interval: float) -> float:
    """Seconds between heartbeats of a node that counts ``peers`` stretching nodes (itself included).

    Up to ``stretch_above`` peers: ``base``. Beyond, ``base * peers / stretch_above``, so the heartbeats
    all of them send add up to ``stretch_above / base`` a second, capped at ``max_interval``."""
    if peers <= stretch_above:
        return base
    return min(max(base, max_interval), base * peers / stretch_above)


def timeout_for(announced: float | None, *, interval: float, peer_timeout: float,
                max_interval: float) -> float | None:
    """How long a peer that announced ``announced`` s between heartbeats may stay silent before it is
    gone: ``peer_timeout`` scaled by how much longer than our base ``interval`` it beats, honouring at
    most ``max_interval``. None (the default ``peer_timeout``) for a peer that announced nothing or no
    more than our interval."""
    if announced is None or announced <= interval:
        return None
    return peer_timeout * min(announced, max(interval, max_interval)) / interval


class Heartbeats:
    """Publishes this node's heartbeats and tracks everyone else's in ``swarm.peerbook``."""

    def __init__(self, swarm: Swarm, *, interval: float, peer_timeout: float,
                 stretch_above: int = DEFAULT_STRETCH_ABOVE, max_interval: float = DEFAULT_MAX_INTERVAL_S,
                 spawn: Spawn | None = None) -> None:
        self.swarm = swarm
        self._spawn = spawn or _plain_spawn
        self.interval = interval
        self.peer_timeout = peer_timeout
        self.stretch_above = stretch_above
        self.max_interval = max(interval, max_interval)
        self.fixed_rate = bool(FIXED_RATE_ROLES.intersection(swarm.roles))
        """The trainer, validators and a sweep coordinator keep the base interval."""
        self.current_interval = interval
        """The interval announced with the last heartbeat sent."""
        self.topic = topic(swarm.run_id, "heartbeat")
        self.sent = 0
        self.received = 0
        """Valid heartbeats of other peers handled (the rate a node sees; ``snapshot``)."""
        self._started = time.monotonic()
        self.on_alive: list[PeerListener] = []
        """Called (asyncio loop) when a peer is heard for the first time or again after being gone."""
        self.on_gone: list[PeerListener] = []
        """Called (asyncio loop) when a peer has been silent for ``peer_timeout``."""
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self.ignored = {"stale": 0, "repeat": 0}
        """Heartbeats ignored (``MessageIgnored``): stamped outside the window, or not newer than the
        signer's last one."""
        self._latest: OrderedDict[str, tuple[int, int]] = OrderedDict()  # signer -> (seq, time_ms) taken

    def start(self) -> None:
        self.swarm.peerbook.peer_timeout = self.peer_timeout
        self.swarm.subscribe(self.topic, self._validate, self._on_heartbeat)
        self._tasks = [self._spawn("heartbeat-publish", self._publish_loop),
                       self._spawn("heartbeat-sweep", self._sweep_loop)]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []

    def _validate(self, data: bytes, origin: str) -> gossip.Heartbeat:
        """The gossip validator (trio thread; the only user of ``_latest``)."""
        try:
            hb, signer = gossip.open_heartbeat(data, run_id=self.swarm.run_id,
                                               now_ms=int(time.time() * 1000))
            if signer != origin:
                raise ProtocolError(f"heartbeat signed by {signer} published by {origin}")
            last = self._latest.get(signer)
            if last is not None and hb.seq <= last[0] and hb.time_ms <= last[1]:
                raise MessageIgnored(f"heartbeat seq {hb.seq} of {signer} is not newer than seq {last[0]} "
                                     "(a repeat)", kind="repeat")
        except MessageIgnored as exc:
            self.ignored[exc.kind] = self.ignored.get(exc.kind, 0) + 1
            raise
        self._latest[signer] = (hb.seq, hb.time_ms)
        self._latest.move_to_end(signer)
        while len(self._latest) > MAX_LATEST:
            self._latest.popitem(last=False)
        return hb

    def _on_heartbeat(self, hb: gossip.Heartbeat, origin: str) -> None:
        self.received += 1
        # The signed listen addresses beat what the connection showed (an inbound peer's ephemeral port);
        # only for a peer we had a connection with: any key's heartbeat reaches us through gossip.
        self.swarm.peerbook.remember(origin, hb.listen_addrs, if_connected=True)
        announced = None if isinstance(hb.interval_ms, msgspec.UnsetType) else hb.interval_ms / 1000
        timeout = timeout_for(announced, interval=self.interval, peer_timeout=self.peer_timeout,
                              max_interval=self.max_interval)
        if self.swarm.peerbook.heard(origin, http_url=hb.http_url, addrs=hb.listen_addrs, roles=hb.roles,
                                     timeout=timeout):
            log.info("peer %s is alive (%s)", origin, ",".join(hb.roles) or "no role")
            self._notify(self.on_alive, origin)

    def _notify(self, listeners: list[PeerListener], peer: str) -> None:
        for fn in listeners:
            try:
                fn(peer)
            except Exception:  # one listener failing must not stop the others or the loop
                log.exception("peer listener failed for %s", peer)

    def swarm_estimate(self) -> int:
        """Stretching nodes this node counts, itself included: the ``peers`` of the rule."""
        return 1 + self.swarm.peerbook.count_alive(without_roles=FIXED_RATE_ROLES)

    def next_interval(self) -> float:
        if self.fixed_rate:
            return self.interval
        target = stretched_interval(self.interval, self.swarm_estimate(), stretch_above=self.stretch_above,
                                   max_interval=self.max_interval)
        return min(target, self.current_interval * MAX_GROWTH)

    def beat(self, interval: float | None = None) -> bytes:
        """A sealed heartbeat; ``interval`` (s until the next one) is announced if above the base."""
        self._seq += 1
        announce: int | msgspec.UnsetType = msgspec.UNSET
        if interval is not None and interval > self.interval:
            announce = min(gossip.MAX_INTERVAL_MS, int(interval * 1000))
        hb = gossip.Heartbeat(run_id=self.swarm.run_id, seq=self._seq, time_ms=int(time.time() * 1000),
                              http_url=self.swarm.http_url,
                              listen_addrs=self.swarm.listen_addrs()[:gossip.MAX_ADDRS],
                              roles=self.swarm.roles[:gossip.MAX_ROLES], interval_ms=announce)
        return self.swarm.key.seal(gossip.HEARTBEAT_DOMAIN, hb)

    async def _publish_loop(self) -> None:
        while True:
            # Decided before sending, because the heartbeat promises it: the next one follows within it.
            interval = self.next_interval()
            try:
                await self.swarm.publish(self.topic, self.beat(interval))
                self.sent += 1
                self.current_interval = interval
            except (TransportError, ProtocolError) as exc:
                if not self.swarm.watch.down_reason:  # during a restart the swarm has said why
                    log.warning("heartbeat not sent: %s", exc)
            await asyncio.sleep(interval * (1 - JITTER * random.random()))

    def snapshot(self) -> dict[str, object]:
        """For ``GET /v1/status``: the interval in use and the heartbeat rates this node sees."""
        elapsed = max(1e-9, time.monotonic() - self._started)
        return {"interval_s": round(self.current_interval, 3), "base_interval_s": self.interval,
                "fixed_rate": self.fixed_rate, "swarm_estimate": self.swarm_estimate(),
                "sent": self.sent, "received": self.received, "ignored": dict(self.ignored),
                "received_per_s": round(self.received / elapsed, 3)}

    async def _sweep_loop(self) -> None:
        period = min(self.interval, self.peer_timeout / 4)
        while True:
            await asyncio.sleep(period)
            for peer in self.swarm.peerbook.sweep():
                log.info("peer %s is gone (no heartbeat for %.1fs)", peer, self.peer_timeout)
                self._notify(self.on_gone, peer)
