"""The connection manager: connections per node bounded by watermarks, whatever the swarm's size.

The libp2p convention (go-libp2p's ``BasicConnMgr``): a node may hold up to ``high`` connections; above
that it closes the least useful ones down to ``low``. A connection younger than ``grace_s`` is never
closed (it has not had the time to prove itself: identify, the pubsub hello, a first lookup). Some peers
are never closed at all:

- the run's trainer and validators (``run.trainer_peer_id``, ``run.validator_peer_ids``): every role
  works with them, and their gossip is what the run is about;
- the first :data:`MAX_PROTECTED_BOOTSTRAP` bootstrap peers this node reached (its way back in);
- relays this node holds reservations on (read from its own advertised ``/p2p-circuit`` addresses) and
  relays that carry one of its relayed connections: closing one cuts every circuit through it;
- peers with a stream of a bulk or relay protocol open (:data:`PROTECTED_PROTOCOLS`: blob chunks over
  libp2p, relay hop/stop): closing them would cut a transfer mid-way;
- peers a service protects by tag (:meth:`ConnManager.protect`, go-libp2p's ``Protect(peer, tag)``):
  a blob fetch from a provider, say.

Among the rest the least useful go first: peers in no gossip mesh before mesh peers (the mesh is what
carries gossip to everyone), then the longest idle (no gossip forwarded to us, no stream opened, since
the oldest time). Bulk bytes move over HTTP and are unaffected by a closed libp2p connection.

Dialing is the other half. py-libp2p's auto-connector dials peers from the peerstore (identify and DHT
answers fill it) up to the midpoint of its watermarks; with the stock settings a node connected to every
peer it learned of. The host sets its target to ``low``: below that it dials known peers
(skipping those it was disconnected from in the last minute, so a trimmed peer is not dialed straight
back), at or above it it dials nobody. A trimmed peer stays in the peerbook and the DHT routing table
and may connect again; the manager trims again only once the node is above ``high``.

Trimming is event-driven (no polling): a new connection or a protection lifted wakes the trimmer on the
trio thread. A trim starts above ``high`` and ends at ``low``: while peers in their grace period keep the
node above ``low``, it sleeps until the first grace ends and closes more. Shortcut: the watermarks count
peers, not connections as go-libp2p does (one connection per peer is the rule here).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:  # libp2p is imported only by the trio thread's code (an import costs about a second)
    from libp2p.abc import IHost
    from libp2p.pubsub.gossipsub import GossipSub

    from intellect_node.config import NodeConfig

log = logging.getLogger(__name__)

DEFAULT_LOW = 32
"""Connections kept after a trim (kubo's ``Swarm.ConnMgr.LowWater`` default)."""
DEFAULT_HIGH = 64
"""Connections above which the node trims (kubo's is 96; ours is lower: our peers also gossip and work)."""
DEFAULT_GRACE_S = 20.0
"""Seconds a new connection is safe from trimming (kubo's ``GracePeriod`` default)."""
MAX_PROTECTED_BOOTSTRAP = 3
"""Bootstrap peers protected: enough to get back in if some leave, few enough not to pin a hub."""
BOOTSTRAP_TAG = "bootstrap"
REMEMBERED_TRIMS = 256
"""Recently trimmed peers kept for the status (the newest; older ones are of no use to an operator)."""


def _protected_protocols() -> frozenset[str]:
    # Deferred: the relay protocol IDs come from libp2p (about a second to import), and the asyncio
    # side imports this module for ConnLimits before libp2p is loaded.
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
    from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP

    from intellect_node.p2p.nat.chunk_stream import PROTOCOL_ID as CHUNKS

    return frozenset({CHUNKS, str(HOP), str(STOP)})


@dataclass(frozen=True)
class ConnLimits:
    """What the manager enforces; ``protected`` are peer IDs never trimmed (the trainer, validators)."""

    low: int = DEFAULT_LOW
    high: int = DEFAULT_HIGH
    grace_s: float = DEFAULT_GRACE_S
    protected: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.low < 0:
            raise ValueError(f"conn_low must be 0 or more, got {self.low}")
        if self.high < max(self.low, 1):
            raise ValueError(f"conn_high ({self.high}) must be at least conn_low ({self.low}) and 1")
        if self.grace_s < 0:
            raise ValueError(f"conn_grace_s must be 0 or more, got {self.grace_s}")

    @classmethod
    def from_config(cls, config: NodeConfig) -> "ConnLimits":
        """From a node's configuration tree: ``[network]`` watermarks, ``[run]`` trainer and validators."""
        net, run = config.network, config.run
        peers = ([run.trainer_peer_id] if run.trainer_peer_id else []) + list(run.validator_peer_ids)
        return cls(low=net.conn_low, high=net.conn_high, grace_s=net.conn_grace_s,
                   protected=tuple(dict.fromkeys(peers)))


@dataclass(frozen=True)
class PeerView:
    """One connected peer as the trimmer sees it (times are ``time.monotonic()``)."""

    peer: str
    connected_at: float
    last_active: float
    in_mesh: bool
    protected: str = ""
    """Why it must stay ("" when it may be trimmed)."""


def plan_trim(peers: list[PeerView], limits: ConnLimits, now: float, *,
              trimming: bool = False) -> tuple[list[str], float | None]:
    """Which peers to close, and in how many seconds to look again (None: the trim is over).

    A trim starts above ``high`` and goes on (``trimming``) until ``low`` remain: unprotected peers past
    their grace period are closed, least useful first; while more than ``low`` remain because of peers
    still in their grace period, look again when the first of those graces ends. Under a stream of new
    connections the node so stays near ``low`` plus the peers in grace, one trim per grace period at most
    behind."""
    if len(peers) <= (limits.low if trimming else limits.high):
        return [], None
    ready = [p for p in peers if not p.protected and now - p.connected_at >= limits.grace_s]
    ready.sort(key=lambda p: (p.in_mesh, p.last_active, p.connected_at))
    closing = [p.peer for p in ready[:len(peers) - limits.low]]
    if len(peers) - len(closing) <= limits.low:
        return closing, None
    waiting = [p.connected_at + limits.grace_s - now for p in peers
               if not p.protected and now - p.connected_at < limits.grace_s]
    return closing, (max(min(waiting), 0.0) if waiting else None)


@dataclass
class _Seen:
    connected_at: float
    last_active: float


@dataclass
class ConnManager:
    """Connection state and protections (thread-safe), and the trimmer (:meth:`run`, trio thread).

    One per :class:`~intellect_node.p2p.swarm.Swarm`: it outlives libp2p restarts, so protections set by
    services hold on the new host."""

    limits: ConnLimits = field(default_factory=ConnLimits)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._tags: dict[str, set[str]] = {}
        self._seen: dict[str, _Seen] = {}
        self._wake: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.trimmed: OrderedDict[str, float] = OrderedDict()
        """Peers closed by the trimmer, newest last (monotonic time), at most REMEMBERED_TRIMS."""
        self.trims = 0
        """Connections closed by the trimmer since start."""

    # -- protection (any thread) ---------------------------------------------------------------------

    def protect(self, peer: str, tag: str) -> None:
        """Never trim ``peer`` while ``tag`` holds (tags are independent, as go-libp2p's)."""
        with self._lock:
            self._tags.setdefault(peer, set()).add(tag)

    def unprotect(self, peer: str, tag: str) -> bool:
        """Lift ``tag``; True if ``peer`` is still protected by another tag (go-libp2p's answer)."""
        with self._lock:
            tags = self._tags.get(peer, set())
            tags.discard(tag)
            if not tags:
                self._tags.pop(peer, None)
            still = bool(tags)
        if not still and self.over_high():
            self.wake()  # it may be trimmable now
        return still

    def protection(self, peer: str) -> str:
        """Why ``peer`` is protected by configuration or tag ("" if not); see also :func:`survey`."""
        if peer in self.limits.protected:
            return "run"
        with self._lock:
            tags = self._tags.get(peer)
            return ",".join(sorted(tags)) if tags else ""

    def protect_bootstrap(self, peers: Iterable[str]) -> None:
        """Protect the first bootstrap peers reached, up to :data:`MAX_PROTECTED_BOOTSTRAP` in all."""
        with self._lock:
            have = sum(1 for tags in self._tags.values() if BOOTSTRAP_TAG in tags)
            for peer in peers:
                if have >= MAX_PROTECTED_BOOTSTRAP:
                    return
                tags = self._tags.setdefault(peer, set())
                if BOOTSTRAP_TAG not in tags:
                    tags.add(BOOTSTRAP_TAG)
                    have += 1

    # -- events (trio thread: the host's notifee and gossip validator) --------------------------------

    def connected(self, peer: str) -> None:
        now = self.clock()
        with self._lock:
            if peer not in self._seen:
                self._seen[peer] = _Seen(now, now)
            over = len(self._seen) > self.limits.high
        if over:
            self.wake()

    def over_high(self) -> bool:
        return len(self._seen) > self.limits.high

    def disconnected(self, peer: str) -> None:
        with self._lock:
            self._seen.pop(peer, None)

    def touch(self, peer: str) -> None:
        """``peer`` did something for us (forwarded gossip, opened a stream): it is not idle."""
        seen = self._seen.get(peer)
        if seen is not None:
            seen.last_active = self.clock()

    def forget_all(self) -> None:
        """The host's connections are gone (a new host after a libp2p restart): count afresh."""
        with self._lock:
            self._seen.clear()

    def seen(self, peer: str) -> tuple[float, float]:
        """(connected_at, last_active) of a connected peer; one whose connect was not seen counts from
        now on (its grace starts now)."""
        with self._lock:
            s = self._seen.get(peer)
            if s is None:
                now = self.clock()
                s = self._seen[peer] = _Seen(now, now)
            return s.connected_at, s.last_active

    def wake(self) -> None:
        """Ask the trimmer to look (from any thread; a no-op before :meth:`run` or after the run ends)."""
        token, event = self._token, self._wake
        if token is None or event is None:
            return
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    # -- the trimmer (trio thread) ---------------------------------------------------------------------

    async def run(self, survey: Callable[[], list[PeerView]],
                  close: Callable[[str], Awaitable[None]]) -> None:
        """Trim whenever woken, until cancelled. ``survey()`` lists the connected peers now;
        ``close(peer)`` closes every connection to one."""
        token = self._token = trio.lowlevel.current_trio_token()
        self._wake = trio.Event()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await self._trim(survey, close)
        finally:
            if self._token is token:  # not a restarted host's run that began meanwhile
                self._token = self._wake = None

    async def _trim(self, survey: Callable[[], list[PeerView]],
                    close: Callable[[str], Awaitable[None]]) -> None:
        trimming = False
        while True:
            peers = survey()
            closing, again = plan_trim(peers, self.limits, self.clock(), trimming=trimming)
            if closing:
                log.info("%d peers connected (watermarks %d/%d): closing %d, least useful first",
                         len(peers), self.limits.low, self.limits.high, len(closing))
            for peer in closing:
                self.trims += 1
                self.trimmed[peer] = self.clock()
                self.trimmed.move_to_end(peer)
                while len(self.trimmed) > REMEMBERED_TRIMS:
                    self.trimmed.popitem(last=False)
                await close(peer)
            if again is None:
                return
            trimming = True
            assert self._wake is not None
            with trio.move_on_after(again):  # a peer's grace ends then (or something else wakes us)
                await self._wake.wait()
            self._wake = trio.Event()

    def snapshot(self, connected: int | None = None) -> dict[str, object]:
        """For status pages: watermarks, protections, trims."""
        with self._lock:
            tagged = len(self._tags)
        out: dict[str, object] = {"low": self.limits.low, "high": self.limits.high,
                                  "grace_s": self.limits.grace_s,
                                  "protected_by_run": len(self.limits.protected),
                                  "protected_by_tag": tagged, "trims": self.trims,
                                  "recently_trimmed": list(self.trimmed)[-8:]}
        if connected is not None:
            out["connected"] = connected
        return out


def survey(mgr: ConnManager, host: IHost, gossipsub: GossipSub) -> list[PeerView]:
    """Connected peers of ``host`` as :class:`PeerView` s (trio thread: reads libp2p state).

    Protection beyond configuration and tags is read from the connections themselves: open streams of a
    :data:`PROTECTED_PROTOCOLS` protocol, relays named in our own circuit addresses (the reservations we
    hold) and relays our relayed connections go through."""
    network = host.get_network()
    protocols = PROTECTED_PROTOCOLS or _load_protocols()
    relays: set[str] = set()
    for addr in host.get_addrs():
        relay = relay_in_addr(str(addr))
        if relay:
            relays.add(relay)
    streaming: set[str] = set()
    for pid, conns in list(network.connections.items()):
        for conn in list(conns):
            try:
                addrs = conn.get_transport_addresses()
            except Exception:  # a closing connection: it has no addresses left
                addrs = []
            for a in addrs:
                relay = relay_in_addr(str(a))
                if relay:
                    relays.add(relay)
            for stream in list(conn.get_streams()):
                if str(stream.get_protocol() or "") in protocols:
                    streaming.add(pid.to_base58())
    in_mesh = {p.to_base58() for peers in list(gossipsub.mesh.values()) for p in list(peers)}
    out = []
    for pid in list(network.connections):
        peer = pid.to_base58()
        why = mgr.protection(peer) or ("relay" if peer in relays else "") or (
            "transfer" if peer in streaming else "")
        connected_at, last_active = mgr.seen(peer)
        out.append(PeerView(peer, connected_at, last_active, peer in in_mesh, why))
    return out


PROTECTED_PROTOCOLS: frozenset[str] = frozenset()
"""Protocols whose open streams protect their connection (filled on first use: libp2p is imported late)."""


def _load_protocols() -> frozenset[str]:
    global PROTECTED_PROTOCOLS
    PROTECTED_PROTOCOLS = _protected_protocols()
    return PROTECTED_PROTOCOLS


def relay_in_addr(addr: str) -> str:
    """The relay's peer ID in a circuit address ``.../p2p/<relay>/p2p-circuit...``, else ""."""
    head, sep, _ = addr.partition("/p2p-circuit")
    if not sep or "/p2p/" not in head:
        return ""
    return head.rsplit("/p2p/", 1)[1].split("/")[0]
