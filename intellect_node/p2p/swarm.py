"""The Swarm facade: the asyncio side of the networking core (see docs/architecture.md, "Swarm facade").

Roles use only this class. It owns the trio thread (:mod:`bridge`) running :class:`host.P2PHost` and
adds what the library does not do for us:

- **Pacing.** gossipsub drops silently: 10 msgs/s per forwarder per topic on stock nodes and a 32-RPC
  outbound queue per peer on stock nodes (ours: 256, ``compat.PEER_OUTBOUND_QUEUE``).
  :meth:`Swarm.publish` spaces messages on one topic at least ``1 / PUBLISH_RATE_PER_TOPIC`` s apart
  and awaits its turn, so a burst is delayed, never dropped.
- **Validation with blame.** ``subscribe(topic, validate, handler)``: ``validate(data, origin)`` runs
  inside the gossip validator on the trio thread; a ``ProtocolError`` drops the message (it is not
  forwarded) and the reason is recorded in the peerbook against the origin (the libp2p-signed
  publisher). A ``MessageIgnored`` (well-formed, signed, only stale or a repeat: what a replay is) drops
  it too, blaming no one, neither the origin nor the forwarder (compat ``gossip-ignore``); both are
  counted per topic and per kind (``dropped``, ``ignored``, ``ignored_why``; ``GET /v1/status``). The
  decoded message goes to ``handler(msg, origin)`` on the asyncio loop.
- **Providers with URLs.** DHT provider records name peers; :meth:`find_providers` de-duplicates them
  and turns each into ``Provider(peer_id, http_url)`` using the URL from its heartbeat or, failing that,
  a signed node-info request (``/intellect/info/1.0.0``, 5 s deadline).
- **Bans.** A banned peer's connections are closed, its gossip is refused, it is skipped as a provider.
- **Bounded connections.** :class:`~intellect_node.p2p.connmgr.ConnManager` trims above ``conn.high``
  down to ``conn.low``, never the protected peers (the run's trainer and validators, the first bootstrap
  peers, relays, transfers, :meth:`Swarm.protect`); it outlives libp2p restarts.
- **Restarts.** :class:`~intellect_node.p2p.liveness.Libp2pWatch` restarts libp2p when it stops
  working. For that the swarm remembers what it asked of libp2p: subscriptions (with their validator
  and handler), provided CIDs (the newest :data:`MAX_REPROVIDE`), bootstrap addresses, and the listen
  addresses as bound (a ``tcp/0`` port stays the port peers know). Services holding trio state of their
  own re-attach through :attr:`Swarm.on_restart`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from intellect_node.aioutil import cancel_and_wait
from intellect_node.errors import MessageIgnored, ProtocolError, TransportError
from intellect_node.p2p.bridge import TrioThread
from intellect_node.p2p.connmgr import ConnLimits, ConnManager
from intellect_node.p2p.liveness import Libp2pWatch
from intellect_node.p2p.peerbook import AUTO_BAN_AFTER, PeerBook
from intellect_node.p2p.ports import check_listen_ports
from intellect_node.protocol import gossip
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import validate_run_id

if TYPE_CHECKING:
    from intellect_node.p2p.compat import InboundSlots
    from intellect_node.p2p.host import Deliver, P2PHost, Validator

log = logging.getLogger(__name__)

PUBLISH_RATE_PER_TOPIC = 8.0
"""Messages/s one node publishes on one topic: under the stock gossipsub limit of 10/s (notes)."""
STASH_SIZE = 4096
"""Validated-but-not-yet-delivered messages kept between the validator and the subscription pump."""
BOOTSTRAP_TIMEOUT_S = 10.0
MAX_REMEMBERED_DIALS = 8
REJOIN_CHECK_S = 2.0
"""How often a node checks that it still has a connection (reading a count: nothing is sent)."""
REJOIN_BACKOFF_S = (2.0, 60.0)
"""Least and most seconds between two rejoins of a node left with no connection: doubled after a
rejoin that reached nobody, reset by one that reached a peer."""
MAX_REPROVIDE = 256
"""Provided CIDs announced again after a libp2p restart, newest first (older ones: policies and batches
long consumed; their holders still answer ``find_providers`` from other peers' records)."""
REPROVIDE_CONCURRENCY = 4
CLOSE_CONNECTIONS_S = 2.0
"""Bound on closing the connections of a host whose run ends (see :func:`_serve_then_close`)."""

Validate = Callable[[bytes, str], object]
"""``validate(data, origin)``: the decoded message (see :meth:`Swarm.subscribe`)."""
Handler = Callable[[Any, str], object]
"""``handler(msg, origin)``, plain or async. The message is left unchecked: each topic's handler takes its
own validator's message type, which one alias for every topic cannot name."""


@dataclass(frozen=True)
class Provider:
    peer_id: str
    http_url: str


def quiet_libp2p_logging(level: int = logging.ERROR) -> None:
    """py-libp2p logs ~60 harmless WARNINGs per short run (EOFs, dial retries) through Python's
    last-resort stderr handler; send its records to our handlers instead, from ``level`` up. Where the CLI
    left a gate on the logger (``logsetup.LibraryNoiseGate`` as ``.intellect_node_gate``) records go
    through it instead (it rate-limits and rewords them for the operator)."""
    import libp2p  # noqa: F401  # its import resets this logger (libp2p/utils/logging.py): import first
    root = logging.getLogger("libp2p")
    gate = getattr(root, "intellect_node_gate", None)
    root.handlers[:] = [gate] if gate is not None else []
    root.propagate = gate is None
    if root.level != logging.DEBUG:  # the CLI's --log-level DEBUG opens it up on purpose
        root.setLevel(level)
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if name.startswith("libp2p.") and isinstance(lg, logging.Logger) and lg.level and lg.level < level:
            lg.setLevel(level)


class Swarm:
    """One node's view of the swarm. Create with :meth:`start`; stop with :meth:`close`."""

    def __init__(self, key: SigningKey, run_id: str, peerbook: PeerBook, http_url: str,
                 roles: list[str], conn: ConnLimits | None = None) -> None:
        self.key = key
        self.peer_id = key.peer_id
        self.run_id = validate_run_id(run_id)
        self.peerbook = peerbook
        self.http_url = http_url
        self.roles = list(roles)
        self._bridge = TrioThread(name=f"libp2p-{self.peer_id[-6:]}")
        self._p2p: P2PHost | None = None  # imported lazily (libp2p costs ~1 s and 85 MB to import)
        self._next_publish: dict[str, float] = defaultdict(float)
        self._publish_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._stash: OrderedDict[bytes, object] = OrderedDict()
        self._tasks: set[asyncio.Task[object]] = set()
        self.dropped: dict[str, int] = defaultdict(int)
        """Messages refused by our validators, per topic."""
        self.ignored: dict[str, int] = defaultdict(int)
        """Messages our validators ignored (``MessageIgnored``: not forwarded, no one blamed), per topic."""
        self.ignored_why: dict[str, int] = defaultdict(int)
        """The same, per ``MessageIgnored.kind`` (``stale``, ``repeat``)."""
        self.delivered: dict[str, int] = defaultdict(int)
        self._closed = False
        self._listen: list[str] = []
        self._announce: list[str] = []
        self._subscriptions: list[tuple[str, Validator, Deliver]] = []  # for restarts
        self._fanout: dict[str, list[tuple[Handler, bool]]] = {}  # topic -> its further subscribers
        self._provided: OrderedDict[str, None] = OrderedDict()
        self._bootstrap_addrs: list[str] = []
        self._rejoin_task: asyncio.Task[None] | None = None
        self.rejoins = 0
        """Times this node found itself with no connection and dialed its bootstrap peers again."""
        self._resubscribing = False
        self.on_restart: list[Callable[[], object]] = []
        """Called (asyncio loop; plain or async) after libp2p was restarted: services holding trio state
        of their own (the NAT service) start it again on the new host here."""
        self.on_fatal: Callable[[str], None] | None = None
        """Called once libp2p cannot be restored (the runtime then exits non-zero)."""
        self.watch = Libp2pWatch(self)
        self.connmgr = ConnManager(conn or ConnLimits())
        """Watermarks, protections and trims (docs/swarm.md, "Connection manager")."""

    @classmethod
    async def start(cls, key: SigningKey, *, run_id: str, listen: list[str], data_dir: Path | None = None,
                    http_url: str = "", roles: list[str] | None = None,
                    peer_timeout: float = 15.0, announce: list[str] | None = None,
                    conn: ConnLimits | None = None, auto_ban_after: int | None = AUTO_BAN_AFTER,
                    run_peers: frozenset[str] = frozenset()) -> "Swarm":
        """Start libp2p (host, DHT, gossipsub) on ``listen`` and return once it listens. ``conn``: the
        connection manager's watermarks and protected peers (``ConnLimits.from_config``);
        ``auto_ban_after``: rejections before the peerbook bans a peer (None: never), except
        ``run_peers`` (``RunConfig.role_peers``), which it never bans by count."""
        quiet_libp2p_logging()
        book = PeerBook(key.peer_id, data_dir, peer_timeout=peer_timeout, auto_ban_after=auto_ban_after,
                        run_peers=run_peers)
        self = cls(key, run_id, book, http_url, roles or [], conn)
        self.peerbook.on_auto_ban = self._auto_ban
        self._listen, self._announce = list(listen), list(announce or [])
        await self._start_host()
        # A restart listens again where peers know us: the ports bound now, not "tcp/0" again.
        self._listen = await self._bridge.call(_bound_addrs, self.p2p) or self._listen
        log.info("libp2p up as %s on %s", self.peer_id, ", ".join(self.listen_addrs()))
        self.watch.start()
        return self

    async def _start_host(self) -> None:
        from intellect_node.p2p import host as hostmod

        p2p = self._p2p = hostmod.P2PHost(self.key, self._listen, self.peerbook, self._node_info_bytes,
                                          self._announce, self.connmgr)

        async def root(nursery: trio.Nursery, _bridge: TrioThread) -> None:
            await nursery.start(_serve_then_close, p2p)

        await self._bridge.start(root)

    # -- restarts (driven by liveness.Libp2pWatch) ---------------------------------------------------

    async def restart_host(self, *, join_timeout: float = 3.0) -> None:
        """Stop what is left of the libp2p run, start a new host on the same key and listen addresses,
        and subscribe again to every topic. Raises whatever keeps the new host from starting."""
        self._resubscribing = True
        try:
            await self._bridge.astop(join_timeout)
            # A wedged old thread that was left behind still holds its listen socket, and libp2p binds
            # with SO_REUSEPORT, so the new host would share the port with a listener that never answers.
            check_listen_ports(self._listen)
            for rec in self.peerbook.snapshot():  # the old host's connections are gone with it
                if rec["connected"]:
                    self.peerbook.set_connected(rec["peer_id"], False)
            await self._start_host()
            i = 0
            while i < len(self._subscriptions):  # by index: a subscribe() meanwhile is picked up too
                await self._bridge.call(self.p2p.subscribe, *self._subscriptions[i])
                i += 1
        finally:
            self._resubscribing = False

    async def replay(self, connected_before: list[str]) -> None:
        """After :meth:`restart_host`: services re-attach, then dial the bootstrap and previously
        connected peers (remembered ones if none answers), then provide every remembered CID again."""
        for fn in list(self.on_restart):
            try:
                result = fn()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # one service failing to re-attach must not keep the others from it
                log.exception("re-attaching %r after the libp2p restart failed", fn)
        addrs = list(self._bootstrap_addrs)
        for peer in connected_before:
            addrs += self.peerbook.addrs(peer)[:1]
        reached = await self.bootstrap(list(dict.fromkeys(addrs)), remember=False)  # or remembered peers
        log.info("after the libp2p restart: %d peers dialed back", len(reached))
        cids = list(reversed(self._provided))
        sem = asyncio.Semaphore(REPROVIDE_CONCURRENCY)

        async def again(cid: str) -> None:
            async with sem:
                try:
                    await self.provide(cid)
                except (TransportError, ProtocolError) as exc:
                    log.info("providing %s again failed: %s", cid, exc)

        await asyncio.gather(*(again(c) for c in cids))

    def fatal(self, reason: str) -> None:
        """libp2p cannot be restored: tell the owner (the runtime exits), or just log without one."""
        if self.on_fatal is not None:
            self.on_fatal(reason)

    @property
    def bridge(self) -> TrioThread:
        """The trio thread: ``await swarm.bridge.call(fn, ...)`` runs trio code next to the host."""
        return self._bridge

    @property
    def p2p(self) -> P2PHost:
        """The :class:`host.P2PHost` (``.host``, ``.dht``, ``.pubsub``); touch it only on the trio thread.
        :meth:`start` creates it (and a restart a new one)."""
        if self._p2p is None:
            raise TransportError("libp2p is not started (Swarm.start creates the host)")
        return self._p2p

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.watch.close()
        if self._rejoin_task is not None:
            await cancel_and_wait([self._rejoin_task])
        for t in list(self._tasks):
            t.cancel()
        await asyncio.to_thread(self.peerbook.save, True)
        await self._bridge.astop(join_timeout=10.0)

    async def __aenter__(self) -> "Swarm":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- addresses and peers -------------------------------------------------------------------------

    def listen_addrs(self) -> list[str]:
        """Full multiaddrs ending ``/p2p/<id>`` (refreshed every few seconds on the trio thread)."""
        return list(self.p2p.addrs_snapshot)

    def connected_peers(self) -> list[str]:
        return self.p2p.connected_peers()

    def inbound(self) -> InboundSlots:
        """How full the inbound connection cap is (``compat.inbound_slots``)."""
        return self.p2p.inbound()

    async def connect(self, addr: str) -> str:
        """Dial a ``.../p2p/<id>`` multiaddr; return the peer ID (TransportError if it fails)."""
        return await self._bridge.call(self.p2p.connect, addr)

    async def bootstrap(self, addrs: list[str], *, timeout: float = BOOTSTRAP_TIMEOUT_S,
                        remember: bool = True) -> list[str]:
        """Dial ``addrs`` together; if none answers, dial remembered peers. Returns peers reached.
        ``addrs`` are dialed again after a libp2p restart (unless ``remember=False``); the first few
        bootstrap peers reached are never trimmed (``connmgr.MAX_PROTECTED_BOOTSTRAP``)."""
        if remember:
            self._bootstrap_addrs = list(dict.fromkeys(self._bootstrap_addrs + list(addrs)))
        reached = await self._dial_all(addrs, timeout)
        if remember:
            self.connmgr.protect_bootstrap(reached)
            if self._rejoin_task is None and not self._closed:
                self._rejoin_task = asyncio.create_task(self._stay_joined(), name="swarm-rejoin")
        if reached:  # learn more peers than the bootstrap ones (in the background: about half a second)
            try:
                self._bridge.start_soon(self.p2p.discover)
            except TransportError:  # libp2p just went down: the restart's replay bootstraps again
                pass
        if not reached:
            fallback = [a[0] for _p, a in self.peerbook.remembered()[:MAX_REMEMBERED_DIALS] if a]
            if fallback:
                log.info("no bootstrap peer answered; trying %d remembered peers", len(fallback))
                reached = await self._dial_all(fallback, timeout)
        return reached

    async def _stay_joined(self) -> None:
        """Dial the bootstrap peers (or remembered ones) again whenever this node is left with no
        connection. The other side of a trim: a node that joined through one busy peer is trimmed by it
        once its grace ends, and on a loaded machine its first lookup may not have found others by then.
        libp2p's auto-connector would leave it alone for a minute (it skips a peer it was disconnected
        from in the last 60 s, and looks only every 30 s); an explicit dial does not skip, and one
        connection puts the node back in the gossip mesh and lets its next lookup find more peers."""
        lo, hi = REJOIN_BACKOFF_S
        wait = lo
        while not self._closed:
            await asyncio.sleep(REJOIN_CHECK_S)
            try:
                if self._resubscribing or self._p2p is None or self.connected_peers():
                    wait = lo
                    continue
                self.rejoins += 1
                log.info("no connection left: dialing %d bootstrap peers again", len(self._bootstrap_addrs))
                reached = await self.bootstrap(list(self._bootstrap_addrs), remember=False)
            except Exception:  # an essential loop: one failed round must not end it
                log.exception("rejoining the swarm failed")
                reached = []
            if not reached:
                await asyncio.sleep(wait)
                wait = min(2 * wait, hi)

    async def _dial_all(self, addrs: list[str], timeout: float) -> list[str]:
        async def one(addr: str) -> str | None:
            try:
                return await asyncio.wait_for(self.connect(addr), timeout)
            except (TransportError, asyncio.TimeoutError) as exc:
                log.warning("cannot reach %s: %s", addr, exc)
                return None

        results = await asyncio.gather(*(one(a) for a in addrs))
        return [p for p in results if p]

    def protect(self, peer: str, tag: str) -> None:
        """Keep the connection to ``peer`` while ``tag`` holds (a transfer, a job): never trimmed."""
        self.connmgr.protect(peer, tag)

    def unprotect(self, peer: str, tag: str) -> bool:
        """Lift ``tag``; True while another tag still protects ``peer``."""
        return self.connmgr.unprotect(peer, tag)

    def topic_peers(self, topic: str) -> list[str]:
        """Peers known to subscribe to ``topic`` (reading libp2p state from this thread is a benign race)."""
        return self.p2p.topic_peers(topic)

    def mesh_peers(self, topic: str) -> list[str]:
        return self.p2p.mesh_peers(topic)

    # -- gossip --------------------------------------------------------------------------------------

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` (a sealed envelope) on ``topic``, paced so no library queue or limit drops it."""
        async with self._publish_locks[topic]:
            wait = self._next_publish[topic] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._next_publish[topic] = time.monotonic() + 1.0 / PUBLISH_RATE_PER_TOPIC
            await self._bridge.call(self.p2p.publish, topic, data)

    def subscribe(self, topic: str, validate: Validate, handler: Handler, *,
                  include_own: bool = False) -> None:
        """Receive ``topic``. ``validate(data, origin)`` returns the decoded message or raises
        ProtocolError (dropped, not forwarded, blamed on ``origin``) or MessageIgnored (dropped, not
        forwarded, blamed on no one); ``handler(msg, origin)`` (plain or async) then runs on the asyncio
        loop. Own messages are skipped unless ``include_own``. A topic has one message type: a second
        subscriber of a topic (two roles of one node) gets the messages its first subscriber's
        ``validate`` decoded (libp2p keeps one validator per topic)."""
        more = self._fanout.get(topic)
        if more is not None:
            more.append((handler, include_own))
            return
        self._fanout[topic] = more = []

        def validator(data: bytes, origin: str, msg_id: bytes) -> bool | None:
            try:
                msg = validate(data, origin)
            except MessageIgnored as exc:  # stale or a repeat: not forwarded, not held against anyone
                self.ignored[topic] += 1
                self.ignored_why[exc.kind] += 1
                return None
            except ProtocolError as exc:
                self.dropped[topic] += 1
                self.peerbook.record_rejection(origin, f"{topic}: {exc}")
                return False
            except Exception as exc:  # a bug in a validator must not kill the libp2p thread
                log.exception("validator for %s crashed on a message from %s", topic, origin)
                self.dropped[topic] += 1
                self.peerbook.record_rejection(origin, f"{topic}: validator crashed: {exc!r}")
                return False
            self._stash[msg_id] = msg
            while len(self._stash) > STASH_SIZE:
                self._stash.popitem(last=False)
            return True

        seen: OrderedDict[bytes, None] = OrderedDict()

        def deliver(data: bytes, origin: str, msg_id: bytes) -> None:
            msg = self._stash.pop(msg_id, None)
            if msg is None or msg_id in seen:
                return
            # A restarted host has an empty seen-cache and peers' gossip brings recent messages again.
            seen[msg_id] = None
            if len(seen) > STASH_SIZE:
                seen.popitem(last=False)
            own = origin == self.peer_id
            for h, with_own in ((handler, include_own), *more):
                if with_own or not own:
                    self.delivered[topic] += 1
                    self._bridge.to_asyncio(self._dispatch, topic, h, msg, origin)

        self._subscriptions.append((topic, validator, deliver))
        if not self._resubscribing and not self.watch.down_reason:  # else the restart subscribes it
            try:
                self._bridge.start_soon(self.p2p.subscribe, topic, validator, deliver)
            except TransportError:  # libp2p just went down: the watch restarts it and subscribes then
                log.info("libp2p is down; %s is subscribed when it is back", topic)

    def _dispatch(self, topic: str, handler: Handler, msg: object, origin: str) -> None:
        try:
            result = handler(msg, origin)
        except Exception:  # one handler failing must not stop delivery of the next message
            log.exception("handler for %s failed on a message from %s", topic, origin)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gossip handler failed", exc_info=task.exception())

    # -- DHT -----------------------------------------------------------------------------------------

    async def provide(self, cid: str) -> None:
        """Announce that this node holds ``cid`` (a DHT provider record; made again after a restart)."""
        self._provided[cid] = None
        self._provided.move_to_end(cid)
        while len(self._provided) > MAX_REPROVIDE:
            self._provided.popitem(last=False)
        await self._bridge.call(self.p2p.provide, cid)

    async def find_providers(self, cid: str, *, count: int = 20) -> list[Provider]:
        """Distinct, unbanned providers of ``cid`` with a resolvable HTTP URL (this node included)."""
        infos = await self._bridge.call(self.p2p.find_providers, cid, count)
        peers = list(dict.fromkeys(i.peer_id.to_base58() for i in infos))
        # Banned peers are out; so are peers whose heartbeats stopped (a cached record of a dead node).
        peers = [p for p in peers if not self.peerbook.is_banned(p) and self.peerbook.state(p) != "gone"]

        async def url_of(peer: str) -> str:
            if peer == self.peer_id:
                return self.http_url
            url = self.peerbook.http_url(peer)
            if url:
                return url
            try:
                return await self.resolve(peer)
            except (TransportError, ProtocolError) as exc:
                log.info("provider %s of %s has no reachable node info: %s", peer, cid, exc)
                return ""

        urls = await asyncio.gather(*(url_of(p) for p in peers))
        return [Provider(p, u) for p, u in zip(peers, urls) if u]

    async def resolve(self, peer: str) -> str:
        """Ask ``peer`` for its signed node info; cache and return its HTTP base URL."""
        raw = await self._bridge.call(self.p2p.request_info, peer, gossip.MAX_NODE_INFO_SIZE + 512)
        try:
            info = gossip.open_node_info(raw, expected_signer=peer)
        except ProtocolError as exc:
            self.peerbook.record_rejection(peer, f"node info: {exc}")
            raise
        self.peerbook.set_info(peer, http_url=info.http_url, addrs=info.listen_addrs, roles=info.roles)
        return info.http_url

    def _node_info_bytes(self) -> bytes:
        info = gossip.NodeInfo(run_id=self.run_id, time_ms=int(time.time() * 1000), http_url=self.http_url,
                               listen_addrs=self.listen_addrs()[:gossip.MAX_ADDRS], roles=self.roles)
        return self.key.seal(gossip.NODE_INFO_DOMAIN, info)

    # -- bans ----------------------------------------------------------------------------------------

    async def ban(self, peer: str, reason: str) -> None:
        """Ban ``peer``: record why (persisted at once: a restart keeps it), close its connections,
        refuse its gossip and provider records."""
        self.peerbook.ban(peer, reason)
        await asyncio.to_thread(self.peerbook.save, True)
        try:
            await self._bridge.call(self.p2p.ban, peer)
        except ValueError as exc:  # not a peer ID libp2p can parse
            raise ProtocolError(f"cannot ban {peer!r}: {exc}") from exc

    def _auto_ban(self, peer: str) -> None:
        async def ban() -> None:
            try:
                await self.p2p.ban(peer)
            except Exception as exc:  # background edge: the peerbook ban already refuses its input
                log.debug("closing auto-banned %s: %r", peer, exc)

        try:
            self._bridge.start_soon(ban)
        except TransportError:  # shutting down
            pass

    def is_banned(self, peer: str) -> bool:
        return self.peerbook.is_banned(peer)


async def _bound_addrs(p2p: P2PHost) -> list[str]:
    """On the trio thread: the transport addresses the host listens on, ports as bound."""
    return [str(a) for a in p2p.host.get_transport_addrs()]


async def _serve_then_close(p2p: P2PHost, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run ``p2p.serve`` and, however it ends, close every connection it holds (bounded, shielded), so
    every peer sees us leave at once and takes our restarted host's new connection (workaround
    ``close-connections-on-exit`` in ``p2p/compat.py``)."""
    from intellect_node.p2p import compat as compat

    try:
        await p2p.serve(task_status=task_status)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_CONNECTIONS_S):
            await compat.close_connections(p2p.host)
