"""The Swarm facade: the asyncio side of the networking core (see docs/architecture.md, "Swarm facade").

Roles use only this class. It owns the trio thread (:mod:`bridge`) running :class:`host.P2PHost` and
adds what the library does not do for us:

- **Pacing.** gossipsub drops silently: 10 msgs/s per forwarder per topic on stock nodes and a 32-RPC
  outbound queue per peer (notes). :meth:`Swarm.publish` spaces messages on one topic at least
  ``1 / PUBLISH_RATE_PER_TOPIC`` s apart and awaits its turn, so a burst is delayed, never dropped.
- **Validation with blame.** ``subscribe(topic, validate, handler)``: ``validate(data, origin)`` runs
  inside the gossip validator on the trio thread; a ``ProtocolError`` drops the message (it is not
  forwarded) and the reason is recorded in the peerbook against the origin (the libp2p-signed
  publisher). The decoded message goes to ``handler(msg, origin)`` on the asyncio loop.
- **Providers with URLs.** DHT provider records name peers; :meth:`find_providers` de-duplicates them
  and turns each into ``Provider(peer_id, http_url)`` using the URL from its heartbeat or, failing that,
  a signed node-info request (``/intellect/info/1.0.0``, 5 s deadline).
- **Bans.** A banned peer's connections are closed, its gossip is refused, it is skipped as a provider.
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
from typing import Any

import trio

from intellect_node.errors import ProtocolError, TransportError
from intellect_node.node.bridge import TrioThread
from intellect_node.node.peerbook import PeerBook
from intellect_node.protocol import gossip
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import validate_run_id

log = logging.getLogger(__name__)

PUBLISH_RATE_PER_TOPIC = 8.0
"""Messages/s one node publishes on one topic: under the stock gossipsub limit of 10/s (notes)."""
STASH_SIZE = 4096
"""Validated-but-not-yet-delivered messages kept between the validator and the subscription pump."""
RESOLVE_TIMEOUT_S = 5.0
BOOTSTRAP_TIMEOUT_S = 10.0
MAX_REMEMBERED_DIALS = 8

Validate = Callable[[bytes, str], Any]
Handler = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Provider:
    peer_id: str
    http_url: str


def quiet_libp2p_logging(level: int = logging.ERROR) -> None:
    """py-libp2p logs ~60 harmless WARNINGs per short run (EOFs, dial retries) through Python's
    last-resort stderr handler; send its records to our handlers instead, from ``level`` up."""
    root = logging.getLogger("libp2p")
    root.handlers.clear()
    root.propagate = True
    if root.level != logging.DEBUG:  # the CLI's --log-level DEBUG opens it up on purpose
        root.setLevel(level)
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if name.startswith("libp2p.") and isinstance(lg, logging.Logger) and lg.level and lg.level < level:
            lg.setLevel(level)


class Swarm:
    """One node's view of the swarm. Create with :meth:`start`; stop with :meth:`close`."""

    def __init__(self, key: SigningKey, run_id: str, peerbook: PeerBook, http_url: str,
                 roles: list[str]) -> None:
        self.key = key
        self.peer_id = key.peer_id
        self.run_id = validate_run_id(run_id)
        self.peerbook = peerbook
        self.http_url = http_url
        self.roles = list(roles)
        self._bridge = TrioThread(name=f"libp2p-{self.peer_id[-6:]}")
        self._p2p: Any = None  # host.P2PHost, imported lazily (libp2p costs ~1 s and 85 MB to import)
        self._next_publish: dict[str, float] = defaultdict(float)
        self._publish_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._stash: OrderedDict[bytes, Any] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.dropped: dict[str, int] = defaultdict(int)
        """Messages refused by our validators, per topic."""
        self.delivered: dict[str, int] = defaultdict(int)
        self._closed = False

    @classmethod
    async def start(cls, key: SigningKey, *, run_id: str, listen: list[str], data_dir: Path | None = None,
                    http_url: str = "", roles: list[str] | None = None,
                    peer_timeout: float = 15.0, announce: list[str] | None = None) -> "Swarm":
        """Start libp2p (host, DHT, gossipsub) on ``listen`` and return once it listens."""
        from intellect_node.node import host as hostmod

        quiet_libp2p_logging()
        self = cls(key, run_id, PeerBook(key.peer_id, data_dir, peer_timeout=peer_timeout), http_url,
                   roles or [])
        self.peerbook.on_auto_ban = self._auto_ban
        p2p = self._p2p = hostmod.P2PHost(key, listen, self.peerbook, self._node_info_bytes, announce)

        async def root(nursery: trio.Nursery, _bridge: TrioThread) -> None:
            await nursery.start(p2p.serve)

        await self._bridge.start(root)
        log.info("libp2p up as %s on %s", self.peer_id, ", ".join(self.listen_addrs()))
        return self

    @property
    def bridge(self) -> TrioThread:
        """The trio thread: ``await swarm.bridge.call(fn, ...)`` runs trio code next to the host."""
        return self._bridge

    @property
    def p2p(self) -> Any:
        """The :class:`host.P2PHost` (``.host``, ``.dht``, ``.pubsub``); touch it only on the trio thread."""
        return self._p2p

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
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
        return list(self._p2p.addrs_snapshot)

    def connected_peers(self) -> list[str]:
        return self._p2p.connected_peers()

    async def connect(self, addr: str) -> str:
        """Dial a ``.../p2p/<id>`` multiaddr; return the peer ID (TransportError if it fails)."""
        return await self._bridge.call(self._p2p.connect, addr)

    async def bootstrap(self, addrs: list[str], *, timeout: float = BOOTSTRAP_TIMEOUT_S) -> list[str]:
        """Dial ``addrs`` together; if none answers, dial remembered peers. Returns peers reached."""
        reached = await self._dial_all(addrs, timeout)
        if not reached:
            fallback = [a[0] for _p, a in self.peerbook.remembered()[:MAX_REMEMBERED_DIALS] if a]
            if fallback:
                log.info("no bootstrap peer answered; trying %d remembered peers", len(fallback))
                reached = await self._dial_all(fallback, timeout)
        return reached

    async def _dial_all(self, addrs: list[str], timeout: float) -> list[str]:
        async def one(addr: str) -> str | None:
            try:
                return await asyncio.wait_for(self.connect(addr), timeout)
            except (TransportError, asyncio.TimeoutError) as exc:
                log.warning("cannot reach %s: %s", addr, exc)
                return None

        results = await asyncio.gather(*(one(a) for a in addrs))
        return [p for p in results if p]

    def topic_peers(self, topic: str) -> list[str]:
        """Peers known to subscribe to ``topic`` (reading libp2p state from this thread is a benign race)."""
        return self._p2p.topic_peers(topic)

    def mesh_peers(self, topic: str) -> list[str]:
        return self._p2p.mesh_peers(topic)

    # -- gossip --------------------------------------------------------------------------------------

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` (a sealed envelope) on ``topic``, paced so no library queue or limit drops it."""
        async with self._publish_locks[topic]:
            wait = self._next_publish[topic] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._next_publish[topic] = time.monotonic() + 1.0 / PUBLISH_RATE_PER_TOPIC
            await self._bridge.call(self._p2p.publish, topic, data)

    def subscribe(self, topic: str, validate: Validate, handler: Handler, *, include_own: bool = False) -> None:
        """Receive ``topic``. ``validate(data, origin)`` returns the decoded message or raises
        ProtocolError (dropped, not forwarded, blamed on ``origin``); ``handler(msg, origin)`` (plain or
        async) then runs on the asyncio loop. Own messages are skipped unless ``include_own``."""

        def validator(data: bytes, origin: str, msg_id: bytes) -> bool:
            try:
                msg = validate(data, origin)
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

        def deliver(data: bytes, origin: str, msg_id: bytes) -> None:
            msg = self._stash.pop(msg_id, None)
            if msg is None or (origin == self.peer_id and not include_own):
                return
            self.delivered[topic] += 1
            self._bridge.to_asyncio(self._dispatch, topic, handler, msg, origin)

        self._bridge.start_soon(self._p2p.subscribe, topic, validator, deliver)

    def _dispatch(self, topic: str, handler: Handler, msg: Any, origin: str) -> None:
        try:
            result = handler(msg, origin)
        except Exception:  # one handler failing must not stop delivery of the next message
            log.exception("handler for %s failed on a message from %s", topic, origin)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gossip handler failed", exc_info=task.exception())

    # -- DHT -----------------------------------------------------------------------------------------

    async def provide(self, cid: str) -> None:
        """Announce that this node holds ``cid`` (a DHT provider record)."""
        await self._bridge.call(self._p2p.provide, cid)

    async def find_providers(self, cid: str, *, count: int = 20) -> list[Provider]:
        """Distinct, unbanned providers of ``cid`` with a resolvable HTTP URL (this node included)."""
        infos = await self._bridge.call(self._p2p.find_providers, cid, count)
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
        raw = await self._bridge.call(self._p2p.request_info, peer, gossip.MAX_NODE_INFO_SIZE + 512)
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
        """Ban ``peer``: record why, close its connections, refuse its gossip and provider records."""
        self.peerbook.ban(peer, reason)
        try:
            await self._bridge.call(self._p2p.ban, peer)
        except ValueError as exc:  # not a peer ID libp2p can parse
            raise ProtocolError(f"cannot ban {peer!r}: {exc}") from exc

    def _auto_ban(self, peer: str) -> None:
        async def ban() -> None:
            try:
                await self._p2p.ban(peer)
            except Exception as exc:  # background edge: the peerbook ban already refuses its input
                log.debug("closing auto-banned %s: %r", peer, exc)

        try:
            self._bridge.start_soon(ban)
        except TransportError:  # shutting down
            pass

    def is_banned(self, peer: str) -> bool:
        return self.peerbook.is_banned(peer)
