"""Heartbeats: each node announces itself every ``interval`` s; silent peers are marked gone.

A heartbeat is a signed :class:`~intellect_node.protocol.gossip.Heartbeat` on
``/intellect/<run>/heartbeat/1`` carrying the sender's HTTP URL, listen addresses and roles (so
providers resolve to URLs without a round trip). A peer is ``gone`` once ``peer_timeout`` s pass
without one; the sweep runs every ``min(interval, peer_timeout / 4)`` s, so a dead or frozen peer is
marked gone at most ``peer_timeout + sweep period`` after its last heartbeat. Liveness follows
heartbeats, not connections, because a frozen (SIGSTOPped) peer keeps its TCP connection (notes).

Both loops run under the runtime's task supervisor (``spawn``, see ``p2p/liveness.py``). While the
swarm restarts libp2p a failed heartbeat is not logged (the swarm logs the outage once) rather than
every interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from intellect_node.errors import ProtocolError, TransportError
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol import gossip
from intellect_node.protocol.topics import topic

log = logging.getLogger(__name__)

PeerListener = Callable[[str], None]
Spawn = Callable[[str, Callable[[], Awaitable[Any]]], "asyncio.Task[Any]"]


def _plain_spawn(name: str, factory: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
    """Without a runtime (tests of the swarm alone): a plain task, not restarted."""
    return asyncio.ensure_future(factory())


class Heartbeats:
    """Publishes this node's heartbeats and tracks everyone else's in ``swarm.peerbook``."""

    def __init__(self, swarm: Swarm, *, interval: float, peer_timeout: float,
                 spawn: Spawn | None = None) -> None:
        self.swarm = swarm
        self._spawn = spawn or _plain_spawn
        self.interval = interval
        self.peer_timeout = peer_timeout
        self.topic = topic(swarm.run_id, "heartbeat")
        self.sent = 0
        self.on_alive: list[PeerListener] = []
        """Called (asyncio loop) when a peer is heard for the first time or again after being gone."""
        self.on_gone: list[PeerListener] = []
        """Called (asyncio loop) when a peer has been silent for ``peer_timeout``."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._seq = 0

    def start(self) -> None:
        self.swarm.peerbook.peer_timeout = self.peer_timeout
        self.swarm.subscribe(self.topic, self._validate, self._on_heartbeat)
        self._tasks = [self._spawn("heartbeat-publish", self._publish_loop),
                       self._spawn("heartbeat-sweep", self._sweep_loop)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _validate(self, data: bytes, origin: str) -> gossip.Heartbeat:
        hb, signer = gossip.open_heartbeat(data, run_id=self.swarm.run_id, now_ms=int(time.time() * 1000))
        if signer != origin:
            raise ProtocolError(f"heartbeat signed by {signer} published by {origin}")
        return hb

    def _on_heartbeat(self, hb: gossip.Heartbeat, origin: str) -> None:
        # The signed listen addresses beat what the connection showed (an inbound peer's ephemeral port).
        self.swarm.peerbook.remember(origin, hb.listen_addrs)
        if self.swarm.peerbook.heard(origin, http_url=hb.http_url, addrs=hb.listen_addrs, roles=hb.roles):
            log.info("peer %s is alive (%s)", origin, ",".join(hb.roles) or "no role")
            self._notify(self.on_alive, origin)

    def _notify(self, listeners: list[PeerListener], peer: str) -> None:
        for fn in listeners:
            try:
                fn(peer)
            except Exception:  # one listener failing must not stop the others or the loop
                log.exception("peer listener failed for %s", peer)

    def beat(self) -> bytes:
        self._seq += 1
        hb = gossip.Heartbeat(run_id=self.swarm.run_id, seq=self._seq, time_ms=int(time.time() * 1000),
                              http_url=self.swarm.http_url,
                              listen_addrs=self.swarm.listen_addrs()[:gossip.MAX_ADDRS],
                              roles=self.swarm.roles[:gossip.MAX_ROLES])
        return self.swarm.key.seal(gossip.HEARTBEAT_DOMAIN, hb)

    async def _publish_loop(self) -> None:
        while True:
            try:
                await self.swarm.publish(self.topic, self.beat())
                self.sent += 1
            except (TransportError, ProtocolError) as exc:
                if not self.swarm.watch.down_reason:  # during a restart the swarm has said why
                    log.warning("heartbeat not sent: %s", exc)
            await asyncio.sleep(self.interval)

    async def _sweep_loop(self) -> None:
        period = min(self.interval, self.peer_timeout / 4)
        while True:
            await asyncio.sleep(period)
            for peer in self.swarm.peerbook.sweep():
                log.info("peer %s is gone (no heartbeat for %.1fs)", peer, self.peer_timeout)
                self._notify(self.on_gone, peer)
