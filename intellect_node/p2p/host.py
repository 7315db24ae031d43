"""The libp2p side of a node (trio thread): host, Kademlia DHT, gossipsub, node-info protocol.

Everything here runs on the trio thread started by :mod:`intellect_node.p2p.bridge`; the asyncio side
talks to it only through :class:`intellect_node.p2p.swarm.Swarm`.

- Identity: the ed25519 node key seed is the libp2p key, so the peer ID equals ``SigningKey.peer_id``.
- Security: Noise only (``sec_opt`` is explicit); a plaintext dialer fails the security handshake.
- DHT: ``/ipfs/kad/1.0.0`` in server mode. py-libp2p does not put connected peers into the routing table
  (notes), so the connection notifee adds them.
- Gossipsub: meshsub 1.2 and 1.1, heartbeat 1 s (library default 120 s). The library's per-forwarder
  limit of 10 messages/s/topic is raised to :data:`GOSSIP_RATE_LIMIT_PER_TOPIC` on our nodes because a
  forwarder relays *every* publisher's messages on a topic; publishers pace themselves below the stock
  limit (see :mod:`intellect_node.p2p.swarm`). Mesh degrees, message cache and peer scoring for large
  swarms: :mod:`intellect_node.p2p.gossip_params`; the library's adaptive mode is off and low scorers
  leave the mesh (compat's ``adaptive-gossip``, ``score-mesh-prune``).
- Provider lookups: py-libp2p's ``find_providers`` returns only the local cache once it holds any
  provider for the key, so providers that appear later would never be found. :meth:`P2PHost.find_providers`
  does its own iterative walk (shortcut: it calls the provider store's per-peer query helper, a private
  method of the pinned libp2p 0.8.1).
- Connections: bounded by :class:`~intellect_node.p2p.connmgr.ConnManager` (watermarks, grace, protected
  peers); the library's auto-connector dials known peers only while fewer than ``low`` are connected.
- Containment: every inbound stream passes one dispatcher (:mod:`intellect_node.p2p.guard`); a
  handler's failure resets that stream and is held against its peer, never stopping the host.
- Every py-libp2p workaround and private touch lives in :mod:`intellect_node.p2p.compat`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from intellect_node.errors import ConfigError, ProtocolError, TransportError
from intellect_node.p2p import compat as compat
from intellect_node.p2p import gossip_params
from intellect_node.p2p.compat import apply_fixes as apply_libp2p_fixes
from intellect_node.p2p.connmgr import ConnLimits, ConnManager, PeerView, survey
from intellect_node.p2p.peerbook import PeerBook
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import INFO_PROTOCOL_ID

log = logging.getLogger(__name__)

REANNOUNCE_DELAYS_S = (0.5, 1.5, 3.0, 10.0)
"""When a subscription is announced again after subscribing (see ``P2PHost._reannounce``)."""

GOSSIP_HEARTBEAT_S = 1
"""Gossipsub mesh maintenance interval; the library default (120 s) leaves meshes empty for minutes."""
GOSSIP_RATE_LIMIT_PER_TOPIC = 200.0
"""Messages per second per forwarder per topic we accept (library default 10, measured dropping)."""
GOSSIP_MAX_MESSAGE = 512 * 1024
"""Largest gossip payload we publish; libp2p silently drops RPCs over 1 MiB (notes)."""
ADDRS_REFRESH_S = 5.0
SUBSCRIPTION_BUFFER = 4096
"""Accepted messages a subscription may hold before our pump forwards them (library default 32)."""
CONNECT_TIMEOUT_S = 10.0
INFO_TIMEOUT_S = 5.0
DISCOVERY_TIMEOUT_S = 10.0
"""Bound on one Kademlia self-lookup (:meth:`P2PHost.discover`)."""
DISCOVERY_INTERVAL_S = (60.0, 600.0)
"""Least and most seconds between self-lookups the dialer asks for: the interval doubles after a lookup
that found no new peer (a swarm smaller than ``low`` never lets the node reach it) and is reset by one
that did. kubo refreshes its routing table every 10 minutes."""
PROVIDER_QUERY_TIMEOUT_S = 5.0
PROVIDER_WALK_MAX_PEERS = 32
"""Peers asked per provider lookup; bounds a walk through a large or hostile network."""
ALPHA = 3
"""Kademlia lookup concurrency (the paper's alpha)."""

AUTO_CONNECT_INTERVAL_S = 30.0
"""How often the library's auto-connector looks for peers to dial while below ``low`` (its default)."""


def connection_config(limits: ConnLimits) -> ConnectionConfig:
    """The library's connection settings for our watermarks.

    Its auto-connector dials peers from the peerstore up to the midpoint of its two watermarks: both are
    set to our ``low``, so it dials only while fewer than ``low`` peers are connected (with the former
    8/64 it aimed at 36: every peer the node learned of). Its pruner is replaced by our
    :class:`ConnManager` (``compat.replace_pruner``), so its high watermark means nothing else.
    ``max_connections`` is the hard cap past which connections are refused at once (inbound ones past
    ``max_connections - min_connections``): twice ``high``, and at least 16 above it, so a node with small
    watermarks still takes the connections it will trim."""
    return ConnectionConfig(min_connections=min(4, limits.low), low_watermark=limits.low,
                            high_watermark=limits.low, max_connections=max(2 * limits.high, limits.high + 16),
                            auto_connect_interval=AUTO_CONNECT_INTERVAL_S, dial_timeout=CONNECT_TIMEOUT_S)

Validator = Callable[[bytes, str, bytes], bool | None]
"""Gossip validator run on the trio thread: ``(data, origin_peer_id, msg_id)`` -> True: accept and
forward; False: refuse (charged to the forwarder); None: ignore (not forwarded, held against no one;
compat ``gossip-ignore``)."""
Deliver = Callable[[bytes, str, bytes], None]
"""Called on the trio thread for each accepted message: ``(data, origin_peer_id, msg_id)``."""


def parse_multiaddr(text: str, *, flag: str = "--listen") -> multiaddr.Multiaddr:
    """Parse an operator-given multiaddr; ConfigError naming ``flag`` if it does not parse."""
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises several unrelated types for bad input
        raise ConfigError(f"{flag} {text!r} is not a valid multiaddr ({exc}); "
                          "expected e.g. /ip4/127.0.0.1/tcp/4001", field=flag.lstrip("-")) from exc


def parse_peer_multiaddr(text: str, *, flag: str = "--bootstrap") -> PeerInfo:
    """A multiaddr that ends in ``/p2p/<peer id>``; ConfigError naming ``flag`` otherwise."""
    ma = parse_multiaddr(text, flag=flag)
    try:
        return info_from_p2p_addr(ma)
    except Exception as exc:
        raise ConfigError(f"{flag} {text!r} must end with /p2p/<peer id>, e.g. "
                          "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...", field=flag.lstrip("-")) from exc


def _where(addr: str) -> str:
    """``host:port`` of a dial address (what an operator recognises), or the address itself."""
    parts = addr.strip("/").split("/")
    host = next((parts[i + 1] for i, p in enumerate(parts[:-1])
                 if p in ("ip4", "ip6", "dns", "dns4", "dns6")), "")
    port = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("tcp", "udp")), "")
    return f"{host}:{port}" if host and port else addr


def local_ipv4s() -> list[str]:
    """This machine's IPv4 addresses, non-loopback first, 127.0.0.1 last. No packet is sent: the host
    name's addresses, plus the source address the kernel would route to a TEST-NET address through (a
    UDP ``connect`` only consults the routing table); Debian maps the host name to 127.0.1.1."""
    import socket

    ips: set[str] = set()
    try:
        ips.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ips.add(s.getsockname()[0])
    except OSError:  # no route at all: loopback only
        pass
    return sorted(ip for ip in ips if not ip.startswith(("127.", "0."))) + ["127.0.0.1"]


def make_addrs_factory(
        announce: list[str]) -> Callable[[list[multiaddr.Multiaddr]], list[multiaddr.Multiaddr]]:
    """What the host advertises: ``announce`` if given (a public IP, a port forward), else the listen
    addresses with a wildcard (0.0.0.0) replaced by this machine's addresses, so peers get dialable
    addresses in identify, DHT provider records and ``status``."""
    fixed = [parse_multiaddr(a, flag="--announce") for a in announce]
    # local_ipv4s() kept for a minute: get_addrs() runs often.
    checked = 0.0  # monotonic time of the last look
    found: list[str] = []

    def ips() -> list[str]:
        nonlocal checked, found
        if time.monotonic() - checked > 60.0:
            checked, found = time.monotonic(), local_ipv4s()
        return found

    def factory(candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        if fixed:
            return list(fixed)
        out: list[multiaddr.Multiaddr] = []
        for a in candidates:
            text = str(a)
            if text.startswith("/ip4/0.0.0.0/"):
                rest = text[len("/ip4/0.0.0.0"):]
                out.extend(multiaddr.Multiaddr(f"/ip4/{ip}{rest}") for ip in ips())
            else:
                out.append(a)
        return list(dict.fromkeys(out))

    return factory


@runtime_checkable
class _RemoteAddressed(Protocol):
    """What py-libp2p's muxers (yamux, mplex) have and ``IMuxedConn`` does not declare."""

    def get_remote_address(self) -> tuple[str, int] | None: ...


def _remote_ip(conn: INetConn) -> str | None:
    """The IP a connection came from (blob fetches from that peer may go there, ``blobs/addresses.py``);
    None for a relayed connection (the address would be the relay's) or when the transport cannot say."""
    try:
        if any("p2p-circuit" in str(a) for a in conn.get_transport_addresses()):
            return None
        muxed = conn.muxed_conn
        remote = muxed.get_remote_address() if isinstance(muxed, _RemoteAddressed) else None
    except (AttributeError, OSError, ValueError):
        return None
    return remote[0] if remote else None


class _Notifee(INotifee):
    """Connection events: fill the DHT routing table, refuse banned peers, keep the peerbook current."""

    def __init__(self, owner: "P2PHost") -> None:
        self._owner = owner

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._owner._on_connected(conn.muxed_conn.peer_id, _remote_ip(conn))

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._owner._on_disconnected(conn.muxed_conn.peer_id)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        self._owner.connmgr.touch(stream.muxed_conn.peer_id.to_base58())

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, maddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, maddr: multiaddr.Multiaddr) -> None:
        return None


class P2PHost:
    """Owns the libp2p host and its services on the trio thread. Methods are trio coroutines."""

    def __init__(self, key: SigningKey, listen_addrs: list[str], peerbook: PeerBook,
                 node_info: Callable[[], bytes], announce: list[str] | None = None,
                 connmgr: ConnManager | None = None) -> None:
        self.key = key
        self.peerbook = peerbook
        self.connmgr = connmgr if connmgr is not None else ConnManager()
        self.connmgr.forget_all()  # a new host (a restart): the old one's connections went with it
        self._listen = [parse_multiaddr(a) for a in listen_addrs]
        self._node_info = node_info
        self._nursery: trio.Nursery | None = None
        self._discovery_at = 0.0  # trio clock: the dialer's next self-lookup may run from then
        self._discovery_every = DISCOVERY_INTERVAL_S[0]
        self.addrs_snapshot: list[str] = []
        """:meth:`listen_addrs` as of the last refresh, for readers on other threads."""
        apply_libp2p_fixes()
        kp = create_new_key_pair(key.seed)
        self.host = new_host(
            key_pair=kp,
            sec_opt={TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
                kp, noise_privkey=create_x25519_key_pair().private_key)},
            listen_addrs=self._listen,
            connection_config=connection_config(self.connmgr.limits),
            addrs_factory=make_addrs_factory(announce or []),
        )
        if self.host.get_id().to_base58() != key.peer_id:
            raise AssertionError("libp2p peer ID differs from the node key's peer ID")
        # strict_validation: value records only under namespaces with a validator (/pk, /ipns), as
        # go-libp2p does; otherwise any peer may park arbitrary values in our store (notes).
        self.dht = KadDHT(self.host, DHTMode.SERVER, enable_random_walk=False, strict_validation=True)
        # Mesh degrees, message cache and peer scoring for large swarms: p2p/gossip_params.py. The
        # adaptive mode is off: it slows the heartbeat to 30 s in a healthy mesh (compat: adaptive-gossip).
        self.gossipsub = GossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11], degree=gossip_params.D,
            degree_low=gossip_params.D_LOW, degree_high=gossip_params.D_HIGH,
            gossip_window=gossip_params.GOSSIP_WINDOW, gossip_history=gossip_params.GOSSIP_HISTORY,
            heartbeat_interval=GOSSIP_HEARTBEAT_S, heartbeat_initial_delay=0.1,
            max_messages_per_topic_per_second=GOSSIP_RATE_LIMIT_PER_TOPIC,
            score_params=gossip_params.score_params(), adaptive_gossip_enabled=False,
        )
        compat.prune_low_scores(self.gossipsub, gossip_params.MESH_THRESHOLD, self._pruned_for_score)
        compat.idontwant_only_for_large(self.gossipsub)
        self.pubsub = Pubsub(self.host, self.gossipsub, strict_signing=True)
        compat.allow_ignore(self.pubsub)
        compat.replace_pruner(self.host.get_network(), self.connmgr)
        # Below low with few peers to dial, the dialer asks for more: a self-lookup (rate-limited).
        compat.network_of(self.host).auto_connector.set_discovery_callback(self._discover_for_dialer)
        self.host.get_network().register_notifee(_Notifee(self))
        self.host.set_stream_handler(TProtocol(INFO_PROTOCOL_ID), self._serve_info)
        # Every inbound stream of every protocol (ours, the DHT's, gossipsub's, identify, ping and the
        # NAT services registered later) passes this one dispatcher: a failure resets that stream, is
        # held against its peer, and the node serves on (p2p/guard.py).
        compat.contain_streams(self.host, peerbook.record_rejection, peerbook.is_banned)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run host, pubsub, gossipsub and DHT until cancelled; ``started()`` once listening."""
        try:
            async with self.host.run(listen_addrs=self._listen):
                async with background_trio_service(self.pubsub), background_trio_service(self.gossipsub), \
                        background_trio_service(self.dht), trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await self.pubsub.wait_until_ready()
                    self.addrs_snapshot = self.listen_addrs()
                    nursery.start_soon(self._refresh_addrs)
                    nursery.start_soon(self.connmgr.run, self._survey, self.close_peer)
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            compat.stop_seen_cache(self.pubsub)

    async def _refresh_addrs(self) -> None:
        # get_addrs() walks libp2p state that only the trio thread may touch; the asyncio side reads
        # this snapshot instead (identify may add observed addresses over time).
        while True:
            await trio.sleep(ADDRS_REFRESH_S)
            self.addrs_snapshot = self.listen_addrs()

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    def listen_addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()]

    def connected_peers(self) -> list[str]:
        return sorted(p.to_base58() for p in self.host.get_connected_peers())  # a list copy (C, atomic)

    def inbound(self) -> compat.InboundSlots:
        return compat.inbound_slots(self.host)

    # -- connections ---------------------------------------------------------------------------------

    def _on_connected(self, pid: ID, remote_ip: str | None = None) -> None:
        peer = pid.to_base58()
        if self.peerbook.is_banned(peer):
            if self._nursery is not None:
                self._nursery.start_soon(self._close_peer, pid)
            return
        self.peerbook.set_connected(peer, True, remote_ip=remote_ip)
        self.connmgr.connected(peer)
        if self._nursery is not None:
            self._nursery.start_soon(self._add_to_routing_table, pid)

    def _on_disconnected(self, pid: ID) -> None:
        if pid not in self.host.get_network().connections:  # a peer may hold several connections
            self.peerbook.set_connected(pid.to_base58(), False)
            self.connmgr.disconnected(pid.to_base58())

    def _survey(self) -> list[PeerView]:
        return survey(self.connmgr, self.host, self.gossipsub)

    async def close_peer(self, peer: str) -> None:
        """Close every connection to ``peer`` (the connection manager's trim; never raises)."""
        await self._close_peer(ID.from_base58(peer))

    async def _add_to_routing_table(self, pid: ID) -> None:
        # Wait for identify so the peerstore holds the peer's listen addresses (needed by add_peer and
        # remembered in peers.json); bounded, a peer that never identifies is added with what we have.
        with trio.move_on_after(3.0):
            while not self._listen_addrs_of(pid):
                await trio.sleep(0.05)
        try:
            await self.dht.routing_table.add_peer(pid, skip_server_mode_check=True)
        except Exception as exc:  # per-peer edge: a bad peer must not stop the node
            log.debug("could not add %s to the routing table: %r", pid, exc)
        addrs = self._listen_addrs_of(pid)
        if addrs:
            self.peerbook.remember(pid.to_base58(), addrs)

    async def discover(self) -> int:
        """Kademlia's self-lookup: ask the network for the peers closest to our own ID. The lookup
        connects to the peers it asks and leaves their addresses in the peerstore, where the dialer finds
        them while the node is below ``low``; a node that joined through one bootstrap peer so has others
        when that peer trims it. Returns how many peers it learned of."""
        store = self.host.get_peerstore()
        before = set(store.peer_ids())
        with trio.move_on_after(DISCOVERY_TIMEOUT_S):
            try:
                await self.dht.peer_routing.find_closest_peers_network(self.host.get_id().to_bytes())
            except Exception as exc:  # per-peer failures inside the walk; an empty answer is no fault
                log.debug("self-lookup failed: %r", exc)
        return len(set(store.peer_ids()) - before - {self.host.get_id()})

    async def _discover_for_dialer(self) -> None:
        now = trio.current_time()
        if now < self._discovery_at:
            return
        found = await self.discover()
        lo, hi = DISCOVERY_INTERVAL_S
        self._discovery_every = lo if found else min(2 * self._discovery_every, hi)
        self._discovery_at = trio.current_time() + self._discovery_every

    def _listen_addrs_of(self, pid: ID) -> list[str]:
        try:
            addrs = self.host.get_peerstore().addrs(pid)
        except Exception:  # the peerstore raises its own error type for unknown peers
            return []
        out = []
        for a in addrs:
            text = str(a)
            if "/tcp/" in text and "/p2p-circuit" not in text:
                out.append(text if "/p2p/" in text else f"{text}/p2p/{pid.to_base58()}")
        return out

    async def _close_peer(self, pid: ID) -> None:
        # Not the library's close_peer: it forgets a connection the peer opens meanwhile (compat).
        await compat.close_peer(self.host.get_network(), pid)

    async def connect(self, addr: str, timeout: float = CONNECT_TIMEOUT_S) -> str:
        """Dial ``addr`` (must end in /p2p/<id>); return the peer ID. TransportError on failure."""
        info = parse_peer_multiaddr(addr, flag="address")
        peer = info.peer_id.to_base58()
        if self.peerbook.is_banned(peer):
            raise TransportError(f"{peer} is banned")
        # An explicit dial (bootstrap, its retries, an operator's connect) must really dial: py-libp2p
        # 0.8.1 refuses for 60 s to dial a peer whose addresses all failed ("negative cache"), so a
        # bootstrap peer that came up a few seconds after us stayed unreachable for a minute.
        compat.unblock_peer(self.host.get_network(), info.peer_id)
        try:
            with trio.fail_after(timeout):
                await self.host.connect(info)
        except trio.TooSlowError as exc:
            raise TransportError(f"connecting to {addr} timed out after {timeout:.0f}s") from exc
        except Exception as exc:  # libp2p raises a variety of dial/upgrade errors; translate at the edge
            raise TransportError(compat.dial_failure(exc, _where(addr))) from exc
        return peer

    async def ban(self, peer: str) -> None:
        pid = ID.from_base58(peer)
        # Not ``pubsub.add_to_blacklist`` (its teardown can stop the pubsub service: p2p/compat.py).
        compat.blacklist(self.pubsub, pid)
        await self._close_peer(pid)

    # -- gossip --------------------------------------------------------------------------------------

    async def subscribe(self, topic: str, validator: Validator, deliver: Deliver) -> None:
        """Subscribe; ``validator`` runs before forwarding (False refuses the message, None ignores it),
        then ``deliver``."""

        def libp2p_validator(forwarder: ID, msg: rpc_pb2.Message) -> bool | None:
            try:
                origin = ID(msg.from_id).to_base58()
            except Exception:  # from_id is peer-controlled bytes
                self.peerbook.record_rejection(forwarder.to_base58(), "gossip: bad origin id")
                return False
            if self.peerbook.is_banned(origin):
                return False
            accepted = validator(msg.data, origin, msg.from_id + msg.seqno)
            if accepted:  # it carries valid gossip to us: a useful connection
                self.connmgr.touch(forwarder.to_base58())
            return accepted

        self.pubsub.set_topic_validator(topic, compat.ignoring(self.pubsub, libp2p_validator), False)
        # The library hands accepted messages to a subscription through a channel of 32 and drops what
        # does not fit (logged as a warning); a busy trio thread can fall that far behind in a burst.
        # The size is read when the channel is made, and our pump drains it without blocking.
        compat.set_subscription_buffer(SUBSCRIPTION_BUFFER)
        sub = await self.pubsub.subscribe(topic)

        async def pump() -> None:
            async for msg in sub:
                try:
                    origin = ID(msg.from_id).to_base58()
                except Exception:
                    continue
                deliver(msg.data, origin, msg.from_id + msg.seqno)

        assert self._nursery is not None
        self._nursery.start_soon(pump)
        self._nursery.start_soon(self._reannounce, topic)

    async def _reannounce(self, topic: str) -> None:
        """Repeat our SUBSCRIBE to every peer a few times after subscribing.

        py-libp2p 0.8.1 sends the announcement only to peers whose outbound queue exists at that instant
        ("No outbound queue for peer" is skipped, not retried), and a peer whose pubsub stream was being
        opened may already have had our hello from before the subscription: neither path then tells it,
        and it never forwards the topic to us (seen: a star of 5 where a leaf stayed unknown to the hub
        for over 45 s). A repeated SUBSCRIBE is idempotent on the receiver."""
        for delay in REANNOUNCE_DELAYS_S:
            await trio.sleep(delay)
            if topic not in self.pubsub.topic_ids:
                return
            await compat.reannounce_subscription(self.pubsub, topic)

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > GOSSIP_MAX_MESSAGE:
            raise ProtocolError(f"gossip message of {len(data)} bytes exceeds {GOSSIP_MAX_MESSAGE}; "
                                "send bulk data as a blob")
        await self.pubsub.publish(topic, data)

    def topic_peers(self, topic: str) -> list[str]:
        """Peers known to be subscribed to ``topic`` (what a publish can reach directly)."""
        # list() copies the set in one C call, so a reader on another thread never sees it change size.
        return sorted(p.to_base58() for p in list(self.pubsub.peer_topics.get(topic, ())))

    def mesh_peers(self, topic: str) -> list[str]:
        return sorted(p.to_base58() for p in list(self.gossipsub.mesh.get(topic, ())))

    def peer_score(self, peer: str, topic: str) -> float:
        """The peer's gossipsub score on ``topic`` as this node's scorer sees it (p2p/gossip_params.py)."""
        return float(self.gossipsub.scorer.score(ID.from_base58(peer), [topic])) if self.gossipsub.scorer \
            else 0.0

    def _pruned_for_score(self, peer: ID, topic: str, score: float) -> None:
        # The invalid messages behind the score were each recorded already: this one does not count.
        self.peerbook.record_rejection(peer.to_base58(), f"gossip score {score:.0f} on {topic}: pruned "
                                       "from the mesh", counts=False)

    # -- DHT -----------------------------------------------------------------------------------------

    async def provide(self, cid: str) -> bool:
        return await self.dht.provide(cid)

    async def find_providers(self, cid: str, count: int = 20, timeout: float = 10.0) -> list[PeerInfo]:
        """Iterative provider walk (see module docstring); de-duplicated, own record included.

        Ends when ``count`` providers are known, no candidate is left, :data:`PROVIDER_WALK_MAX_PEERS`
        peers were asked, ``timeout`` passed, or a round of ``ALPHA`` queries brought no new provider
        once some are known (the usual case in a small swarm: the records sit on every close peer)."""
        from libp2p.kad_dht.utils import sort_peer_ids_by_distance

        key = compat.encode_dht_key(cid)
        store = self.dht.provider_store
        found: dict[ID, PeerInfo] = {p.peer_id: p for p in store.get_providers(key)}
        me = self.host.get_id()
        with trio.move_on_after(timeout):
            candidates = [p for p in await self.dht.peer_routing.find_closest_peers_network(key) if p != me]
            candidates = list(dict.fromkeys(candidates + list(self.host.get_connected_peers())))
            asked: set[ID] = set()
            while candidates and len(asked) < PROVIDER_WALK_MAX_PEERS and len(found) < count:
                batch = [p for p in candidates[:ALPHA] if p not in asked]
                candidates = candidates[ALPHA:]
                closer: list[ID] = []

                async def ask(peer: ID, closer: list[ID]) -> None:
                    asked.add(peer)
                    with trio.move_on_after(PROVIDER_QUERY_TIMEOUT_S):
                        try:
                            provs, near = await compat.providers_from_peer(self.dht, peer, key)
                        except Exception as exc:  # per-peer edge: one bad answer must not end the walk
                            log.debug("provider query to %s failed: %r", peer, exc)
                            return
                        for p in provs:
                            found.setdefault(p.peer_id, p)
                            if p.addrs:
                                self.host.get_peerstore().add_addrs(p.peer_id, p.addrs, 3600)
                        closer.extend(near)

                before = len(found)
                async with trio.open_nursery() as n:
                    for peer in batch:
                        n.start_soon(ask, peer, closer)
                if found and len(found) == before and len(asked) >= ALPHA:
                    # quiescent: this round found no new provider; more rounds cost more than they bring
                    break
                fresh = [p for p in dict.fromkeys(closer)
                         if p not in asked and p != me and p not in candidates]
                candidates = sort_peer_ids_by_distance(key, candidates + fresh) if fresh else candidates
        return list(found.values())[:count]

    # -- node info -----------------------------------------------------------------------------------

    async def _serve_info(self, stream: INetStream) -> None:
        try:
            with trio.fail_after(INFO_TIMEOUT_S):
                await stream.write(self._node_info())
                await stream.close()
        except Exception as exc:  # per-stream edge: reset so the reader never hangs (notes)
            log.debug("node-info stream failed: %r", exc)
            await _reset(stream)

    async def request_info(self, peer: str, max_size: int, timeout: float = INFO_TIMEOUT_S) -> bytes:
        """Ask ``peer`` for its signed node info; raw envelope bytes (caller verifies)."""
        pid = ID.from_base58(peer)
        stream: INetStream | None = None
        try:
            with trio.fail_after(timeout):
                if pid not in self.host.get_network().connections:
                    addrs = self.host.get_peerstore().addrs(pid)
                    await self.host.connect(PeerInfo(pid, addrs))
                stream = await self.host.new_stream(pid, [TProtocol(INFO_PROTOCOL_ID)])
                buf = bytearray()
                while True:
                    try:
                        chunk = await stream.read(max_size + 1 - len(buf))
                    except StreamEOF:
                        break
                    if not chunk:
                        break
                    buf += chunk
                    if len(buf) > max_size:
                        raise ProtocolError(f"node info from {peer} exceeds {max_size} bytes")
                await stream.close()
                return bytes(buf)
        except ProtocolError:
            if stream is not None:
                await _reset(stream)
            raise
        except trio.TooSlowError as exc:
            if stream is not None:
                await _reset(stream)
            raise TransportError(f"node info from {peer} timed out after {timeout:.0f}s") from exc
        except Exception as exc:  # dial/stream errors of many types; translated at the edge
            if stream is not None:
                await _reset(stream)
            raise TransportError(f"node info from {peer} failed: {exc}") from exc


async def _reset(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception:  # already closed or broken: nothing left to release
        pass
