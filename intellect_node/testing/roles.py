"""The RL roles in one process, behind fakes of the node around them (like ``trio.testing`` for trio).

A role is written against ``roles/common/seams.py``'s ``Runtime`` and ``RoleSwarm``; these are small
stand-ins for them, so a role's logic can be tested without libp2p, a control API or a process per node:

- :class:`FakeSwarm`, :class:`FakePeerbook`, :class:`FakeRuntime`: one role alone. Its publications are
  kept (``swarm.published``), its bans and rejections recorded; a test drives it through its own gossip
  handlers with the messages a peer would send, and a :class:`FakeFetcher` hands over the bytes given.
- :class:`InProcessSwarm`: several roles on one event loop (a trainer, validators, workers), each with
  the real blob service on its own store and data dir. Gossip goes from one node's ``publish`` to every
  other node's ``subscribe`` through the same validate-then-handle steps as ``p2p/swarm.py`` (a
  ``ProtocolError`` is recorded against the sender, a ``MessageIgnored`` dropped, a banned sender
  ignored); blobs go over the nodes' real bulk HTTP routes on 127.0.0.1, found through a provider table
  in place of the DHT (a node may serve routes of its own in their place: a hostile peer's tarpit). A
  node that is stopped hears nothing and serves nothing, as a dead process.

What it leaves out, and the tests that keep real processes for it: the wire (libp2p, the gossip mesh,
NAT), crash safety of a killed process (SIGKILL between two writes), the CLI and the supervisor's
restarts. Loops run as plain tasks: one that fails is recorded in :attr:`InProcessNode.failures` (and
logged), not restarted, so a test sees it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from intellect_node.config import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.protocol.signing import SigningKey

if TYPE_CHECKING:
    from aiohttp.web import RouteDef

    from intellect_node.p2p.swarm import Provider

log = logging.getLogger(__name__)

S = TypeVar("S")
Handler = Callable[[Any, str], Any]
Validate = Callable[[bytes, str], Any]


class FakePeerbook:
    """Rejections and bans recorded in order; HTTP URLs from the in-process swarm (none alone)."""

    def __init__(self, urls: Callable[[str], str] | None = None) -> None:
        self.rejections: list[tuple[str, str]] = []
        self.bans: dict[str, str] = {}
        self._urls = urls

    def record_rejection(self, peer_id: str, reason: str, *, counts: bool = True) -> int:
        self.rejections.append((peer_id, reason))
        return len(self.rejections)

    def ban(self, peer_id: str, reason: str) -> None:
        self.bans[peer_id] = reason

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.bans

    def http_url(self, peer_id: str) -> str:
        return self._urls(peer_id) if self._urls is not None else ""

    def last_rejection(self, peer_id: str) -> str | None:
        """The newest reason recorded against ``peer_id`` (the peerbook's ``last_rejection``)."""
        return next((r for p, r in reversed(self.rejections) if p == peer_id), None)


class FakeSwarm:
    """What a role uses of ``p2p.swarm.Swarm`` (``roles.common.seams.RoleSwarm``), in memory. Alone it
    keeps what is published; in an :class:`InProcessSwarm` it also delivers it to the other nodes."""

    def __init__(self, key: SigningKey, net: InProcessSwarm | None = None) -> None:
        self.key = key
        self.peer_id = key.peer_id
        self.banned: dict[str, str] = {}
        self.peerbook = FakePeerbook(net.url if net is not None else None)
        self.published: list[tuple[str, bytes]] = []
        self.subscriptions: dict[str, list[tuple[Validate, Handler, bool]]] = defaultdict(list)
        self._net = net
        self._tasks: set[asyncio.Task[Any]] = set()

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.banned

    async def ban(self, peer_id: str, reason: str) -> None:
        self.banned[peer_id] = reason

    async def publish(self, topic: str, data: bytes) -> None:
        self.published.append((topic, data))
        if self._net is not None:
            self._net.gossip(self.peer_id, topic, data)

    def subscribe(self, topic: str, validate: Validate, handler: Handler, *,
                  include_own: bool = False) -> None:
        self.subscriptions[topic].append((validate, handler, include_own))

    def connected_peers(self) -> list[str]:
        return self._net.peers(but=self.peer_id) if self._net is not None else []

    async def provide(self, cid: str) -> None:
        if self._net is not None:
            self._net.providers[cid].add(self.peer_id)

    async def find_providers(self, cid: str, *, count: int = 20) -> list[Provider]:
        from intellect_node.p2p.swarm import Provider  # the swarm's own record (that module needs no libp2p)

        if self._net is None:
            return []
        found = [Provider(p, url) for p in sorted(self._net.providers.get(cid, ()))
                 if not self.is_banned(p) and not self.peerbook.is_banned(p) and (url := self._net.url(p))]
        return found[:count]

    def receive(self, origin: str, topic: str, data: bytes) -> None:
        """One gossip message from ``origin``: what ``Swarm.subscribe``'s validator and delivery do."""
        if self.is_banned(origin) or self.peerbook.is_banned(origin):
            return
        for validate, handler, include_own in list(self.subscriptions.get(topic, ())):
            if origin == self.peer_id and not include_own:
                continue
            try:
                msg = validate(data, origin)
            except MessageIgnored:
                continue
            except ProtocolError as exc:
                self.peerbook.record_rejection(origin, f"{topic}: {exc}")
                continue
            if msg is None:
                continue
            try:
                result = handler(msg, origin)
            except Exception:
                log.exception("handler for %s failed on a message from %s", topic, origin)
                continue
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gossip handler failed", exc_info=task.exception())

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks), set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class FakeRuntime:
    """``roles.common.seams.Runtime`` for one role alone: no services (a test hands the role what it
    needs), and no loops (``spawn`` fails the test: these tests drive the handlers themselves)."""

    def __init__(self, config: NodeConfig, key: SigningKey, data_dir: Path) -> None:
        self.config = config
        self.board = StatusBoard()
        self.swarm = FakeSwarm(key)
        self.data_dir = data_dir

    def service(self, kind: type[Any]) -> None:
        return None

    def spawn(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no loops in these tests")


class FakeFetcher:
    """Serves the given bytes for any CID (the blob layer is not what these tests are about)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def fetch(self, cid: str, **kwargs: Any) -> bytes:
        return self.data


def key_of(name: str) -> SigningKey:
    """A node key derived from ``name`` (the same name, the same peer ID, in every run)."""
    return SigningKey(hashlib.sha256(f"intellect-node testing {name}".encode()).digest())


class InProcessNode:
    """One node of an :class:`InProcessSwarm`: a ``Runtime`` with the real blob service (and ledger), the
    role it runs, and the tasks it spawned. Built by :meth:`InProcessSwarm.start`."""

    def __init__(self, net: InProcessSwarm, name: str, key: SigningKey, config: NodeConfig,
                 data_dir: Path, label: str = "") -> None:
        self.net = net
        self.name = name
        self.config = config
        self.data_dir = data_dir
        self.board = StatusBoard(role=label)
        self.swarm = FakeSwarm(key, net)
        self.services: dict[type[Any], Any] = {}
        self.role: Any = None
        self.http_url = ""
        self.failures: list[tuple[str, BaseException]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: Any = None
        self.running = False

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id

    def service(self, kind: type[S]) -> S | None:
        found: S | None = self.services.get(kind)
        return found

    def spawn(self, name: str, factory: Callable[[], Awaitable[Any]], *, essential: bool = True,
              may_end: bool = False) -> asyncio.Task[None]:
        async def run() -> None:
            try:
                await factory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("%s: task %s failed", self.name, name)
                self.failures.append((name, exc))
                return
            if not may_end:
                self.failures.append((name, RuntimeError(f"task {name} returned")))

        task = asyncio.create_task(run(), name=f"{self.name}:{name}")
        self._tasks.append(task)
        return task

    def status(self) -> dict[str, Any]:
        """The role's status (what ``GET /v1/status`` holds under the role's name)."""
        return dict(self.role.status()) if self.role is not None else {}

    async def _open(self, role: Callable[[Any], Any] | None, ledger: bool, audits: bool = False,
                    routes: list[RouteDef] | None = None) -> None:
        from aiohttp import web

        from intellect_node.blobs.service import BLOBS_DIR, BlobService
        from intellect_node.blobs.store import BlobStore
        from intellect_node.config.ledger import LedgerService

        self.data_dir.mkdir(parents=True, exist_ok=True)
        sw = self.swarm

        def penalise(peer_id: str, reason: str) -> None:
            sw.peerbook.record_rejection(peer_id, reason)

        blobs = BlobService(BlobStore(self.data_dir / BLOBS_DIR), sw.key, find_providers=sw.find_providers,
                            provide=sw.provide, penalise=penalise,
                            is_banned=sw.peerbook.is_banned, board=self.board)
        self.services[BlobService] = blobs
        if ledger:
            self.services[LedgerService] = LedgerService(self.data_dir)
        if audits:  # the common service a node runs beside its role (``node/assembly.py``)
            from intellect_node.roles.common.audits import AuditWatch

            node: Any = self  # a Runtime as the roles take it (``role(self)`` below)
            self.services[AuditWatch] = AuditWatch(node)
        app = web.Application(client_max_size=1 << 20)
        app.router.add_routes(blobs.routes() if routes is None else routes)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, shutdown_timeout=1.0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.http_url = f"http://127.0.0.1:{port}"
        self.running = True
        for svc in self.services.values():
            await svc.start()
        if role is not None:
            self.role = role(self)
            await self.role.start()

    async def close(self) -> None:
        """Stop the node as a process ending would: it hears, serves and runs nothing more."""
        if not self.running:
            return
        self.running = False
        if self.role is not None:
            await self.role.close()
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.swarm.close()
        for svc in reversed(list(self.services.values())):
            await svc.close()
        if self._runner is not None:
            await self._runner.cleanup()


class InProcessSwarm:
    """Nodes of one run on this event loop (see the module docstring). Use :func:`in_process_swarm`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: dict[str, InProcessNode] = {}  # peer ID -> the running node
        self.providers: dict[str, set[str]] = defaultdict(set)
        self._all: list[InProcessNode] = []

    def url(self, peer_id: str) -> str:
        node = self.nodes.get(peer_id)
        return node.http_url if node is not None and node.running else ""

    def peers(self, *, but: str) -> list[str]:
        return [p for p, n in self.nodes.items() if p != but and n.running]

    def gossip(self, origin: str, topic: str, data: bytes) -> None:
        """``data`` to every running node (the sender too: its own subscriptions skip it), each on the
        loop's next turn, as gossip arrives after the publish returns."""
        loop = asyncio.get_running_loop()
        for node in list(self.nodes.values()):
            if node.running:
                loop.call_soon(node.swarm.receive, origin, topic, data)

    async def start(self, name: str, config: NodeConfig, role: Callable[[Any], Any] | None, *,
                    ledger: bool = True, key: SigningKey | None = None, label: str = "",
                    audits: bool = False, routes: list[RouteDef] | None = None) -> InProcessNode:
        """Node ``name`` (data dir ``root/name``, key :func:`key_of(name) <key_of>` unless ``key``) running
        ``role`` (a factory of a runtime, e.g. ``Trainer.for_runtime``; None: the blob service alone),
        started; one of the same name that ran before is stopped first, as a process replaced. ``label``:
        the role its status snapshot names (``join --role``'s, e.g. ``trainer``), as a dashboard reads it.
        ``audits``: the node also runs the run's audit watch (``roles/common/audits.AuditWatch``), which its
        role consults before it works for the trainer, as on a real node. ``routes``: the HTTP routes
        (aiohttp ``RouteDef``) the node serves in place of its blob service's, e.g. a hostile peer's tarpit
        (what other nodes fetch from it then comes from these)."""
        key = key or key_of(name)
        old = self.nodes.get(key.peer_id)
        if old is not None:
            await old.close()
        node = InProcessNode(self, name, key, config, self.root / name, label)
        self.nodes[key.peer_id] = node
        self._all.append(node)
        await node._open(role, ledger, audits, routes)
        return node

    async def close(self) -> None:
        for node in reversed(self._all):
            await node.close()

    def failures(self) -> list[str]:
        """Every task of every node that failed, as ``node: task: error``."""
        return [f"{n.name}: {t}: {e!r}" for n in self._all for t, e in n.failures]


@asynccontextmanager
async def in_process_swarm(root: Path) -> AsyncIterator[InProcessSwarm]:
    """An :class:`InProcessSwarm` under ``root``, every node stopped on the way out."""
    net = InProcessSwarm(root)
    try:
        yield net
    finally:
        await net.close()


def run_config(*, trainer: str, validators: list[str], rl: dict[str, Any], run_id: str = "inproc",
               model: str | None = None, **run: Any) -> NodeConfig:
    """A node config of an in-process run: ``run`` settings (``async_level``, ``verdict_quorum``, ...) and
    ``rl`` on top of the defaults, the embedded model unless ``model``, metrics off."""
    from intellect_node.models.loader import embedded_model_dir

    return NodeConfig.model_validate({
        "metrics": {"enabled": False},
        "run": {"run_id": run_id, "trainer_peer_id": trainer, "validator_peer_ids": validators,
                "model": model or str(embedded_model_dir()), **run},
        "rl": rl,
    })
