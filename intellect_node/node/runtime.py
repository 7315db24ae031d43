"""The node process: swarm + bulk HTTP app + control API + heartbeats + the services of other parts.

Start order (each step needs the one before):

1. lock the data dir (one node per data dir), load the node key;
2. bind the bulk HTTP socket and the control socket, so the advertised URL is known;
3. start the :class:`~intellect_node.p2p.swarm.Swarm` (libp2p thread) with that URL;
4. build the services from their factories (the seam: ``factory(runtime) -> NodeService``), mount their
   bulk and control routes, start serving HTTP, then ``await service.start()``;
5. heartbeats, bootstrap dials (remembered peers when no bootstrap peer answers);
6. write ``control.json``: from here on the CLI can reach the node; tell systemd ``READY=1``.

Stop (SIGINT, SIGTERM or ``POST /v1/stop``) runs the same steps backwards, each under a deadline, so
the process exits 0 within about :data:`STOP_TIMEOUT_S` seconds even if a peer hangs.

Liveness (``p2p/liveness.py``): every long-lived loop runs under :meth:`NodeRuntime.spawn`, which
restarts it when it fails; the swarm's watch restarts libp2p. What is restarting shows as ``degraded``
on the status board, and a part that cannot be kept working ends the process with
:data:`~intellect_node.p2p.liveness.EXIT_UNHEALTHY` (:meth:`NodeRuntime.fail`) after the same clean
stop. Under systemd the node pings the watchdog only while libp2p answers and every essential task runs.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from aiohttp import web

from intellect_node import __version__, gcpolicy
from intellect_node.blobs.server import (
    BulkLimits,
    ConnectionGate,
    GatedSite,
    RunnerOptions,
    runner_kwargs,
    send_deadline,
)
from intellect_node.config import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.errors import ConfigError
from intellect_node.node import control
from intellect_node.node.sdnotify import Notifier
from intellect_node.node.tasks import TaskFactory, TaskSupervisor
from intellect_node.p2p.connmgr import ConnLimits
from intellect_node.p2p.heartbeat import Heartbeats
from intellect_node.p2p.identity import ensure_data_dir, load_or_init_key
from intellect_node.p2p.liveness import EXIT_UNHEALTHY
from intellect_node.p2p.ports import check_listen_ports
from intellect_node.p2p.swarm import Swarm

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
"""Upper bound on a clean shutdown; each service gets :data:`SERVICE_STOP_TIMEOUT_S` of it."""
SERVICE_STOP_TIMEOUT_S = 5.0
LOCK_FILE = "node.lock"
BOOTSTRAP_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
"""Waits between bootstrap attempts while no peer is connected (the last one repeats), e.g. when the
bootstrap node starts a little later than this one; :data:`BOOTSTRAP_RETRIES` attempts at most. The first
waits are short: nodes launched together (a compose file, a benchmark) import torch for seconds, and the
one they bootstrap from is then listening a moment later; a dial to a closed port fails at once."""
BOOTSTRAP_RETRIES = 20
NO_PEERS_DEGRADED_S = 30.0
"""A node without a single connected peer for this long reads degraded ("no peers for N s")."""
WATCHDOG_PERIOD_S = 5.0
"""How often the node tells systemd its status when no watchdog timeout is set (with one: half of it)."""


@runtime_checkable
class NodeService(Protocol):
    """What another part plugs into the node. ``routes``/``control_routes``/``status`` are optional."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


ServiceFactory = Callable[["NodeRuntime"], NodeService]
S = TypeVar("S")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind HTTP on {host}:{port} ({exc.strerror}); pick another "
                          "network.http_port / --http-port or free the port", field="http_port") from exc
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _listen_ip(listen: list[str]) -> str:
    for part in ("/ip4/", "/ip6/"):
        if listen[0].startswith(part):
            return listen[0][len(part):].split("/", 1)[0]
    return "127.0.0.1"


def _advertised_host(bind_host: str) -> str:
    if bind_host not in ("0.0.0.0", "::"):
        return f"[{bind_host}]" if ":" in bind_host else bind_host
    # Wildcard bind without http_public_url: this machine's first non-loopback address.
    from intellect_node.p2p.host import local_ipv4s

    return local_ipv4s()[0]


class NodeRuntime:
    """One node. ``await start()``, then ``await wait_stopped()`` (or :func:`run_node` for a process)."""

    def __init__(self, config: NodeConfig, data_dir: Path, *, roles: list[str] | None = None,
                 services: list[ServiceFactory] | None = None) -> None:
        self.config = config
        self.data_dir = data_dir
        self.roles = list(roles or [])
        self.board = StatusBoard(role=",".join(self.roles))
        self._swarm: Swarm | None = None  # started by start(): see :attr:`swarm`
        self.heartbeats: Heartbeats | None = None
        self.services: list[NodeService] = []
        """Built in the order they were added (started in it, closed in reverse)."""
        self._by_class: dict[type, NodeService] = {}  # what :meth:`service` answers
        self._factories = list(services or [])
        self._runners: list[web.AppRunner] = []
        self.http_gate = ConnectionGate(BulkLimits())
        self._stop_event = asyncio.Event()
        self._lock_fd: int | None = None
        self._token = control.new_token()
        self.http_url = ""
        self.control_url = ""
        self._status_task: asyncio.Task[None] | None = None
        self._bootstrap_task: asyncio.Task[None] | None = None
        self._started = False
        self.exit_code = 0
        """What the process exits with: 0, or :data:`EXIT_UNHEALTHY` after :meth:`fail`."""
        self.notifier = Notifier()
        self.supervisor = TaskSupervisor(on_change=self._task_health, on_fatal=self.fail)
        self._alone_since: float | None = None

    def spawn(self, name: str, factory: TaskFactory, *, essential: bool = True,
              may_end: bool = False) -> asyncio.Task[None]:
        """Run the loop ``factory()`` as task ``name`` for the node's lifetime (see ``p2p/liveness.py``):
        if it raises, or returns without ``may_end``, it is logged and started again with a back-off
        (``essential``), and the node exits :data:`EXIT_UNHEALTHY` once it keeps failing. Cancel the
        returned task to stop it."""
        return self.supervisor.spawn(name, factory, essential=essential, may_end=may_end)

    def fail(self, reason: str, code: int = EXIT_UNHEALTHY) -> None:
        """A part of the node cannot be kept working: stop cleanly, then exit with ``code``."""
        if self.exit_code == 0:
            self.exit_code = code
            log.critical("stopping the node (exit code %d): %s", code, reason)
        self.board.set_degraded("fatal", reason)
        self.request_stop()

    @property
    def swarm(self) -> Swarm:
        """The node's swarm; set from early in :meth:`start` (the services are built after it)."""
        if self._swarm is None:
            raise RuntimeError("the swarm starts in NodeRuntime.start(); nothing may use it before")
        return self._swarm

    def _task_health(self, name: str, reason: str) -> None:
        self.board.set_degraded(f"task {name}", reason)
        self.board.set_restarts("tasks", self.supervisor.restarts)

    def _libp2p_health(self, reason: str) -> None:
        self.board.set_degraded("libp2p", reason)
        if self._swarm is not None:
            self.board.set_restarts("libp2p", self._swarm.watch.restarts)

    def problem(self) -> str:
        """"" while libp2p answers and every essential task runs (the watchdog's test), else why not."""
        if self._swarm is None:
            return "libp2p not started"
        if not self._swarm.watch.answering():
            return self._swarm.watch.down_reason or "libp2p does not answer"
        return self.supervisor.problem()

    def service(self, kind: type[S]) -> S | None:
        """The service of class ``kind`` (exactly that class) built so far, or None; of two services of one
        class, the first added."""
        return cast("S | None", self._by_class.get(kind))

    def add_service(self, factory: ServiceFactory) -> None:
        """Register a service factory; call before :meth:`start`."""
        if self._started:
            raise RuntimeError("add services before the runtime starts")
        self._factories.append(factory)

    # -- start -------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True
        net = self.config.network
        ensure_data_dir(self.data_dir)  # 0700: key, token, ledger, logs
        self._lock_data_dir()
        check_listen_ports(net.listen)  # libp2p's SO_REUSEPORT would share a taken port (p2p/ports.py)
        key = load_or_init_key(self.data_dir)
        self.board.set_state("starting")

        bind_host = net.http_host or _listen_ip(net.listen)
        bulk_sock = _bind(bind_host, net.http_port)
        ctl_sock = _bind("127.0.0.1", net.control_port)
        port = bulk_sock.getsockname()[1]
        self.http_url = net.http_public_url or f"http://{_advertised_host(bind_host)}:{port}"
        self.control_url = f"http://127.0.0.1:{ctl_sock.getsockname()[1]}"

        self._swarm = await Swarm.start(key, run_id=self.config.run.run_id, listen=list(net.listen),
                                       data_dir=self.data_dir, http_url=self.http_url, roles=self.roles,
                                       peer_timeout=net.peer_timeout, announce=list(net.announce),
                                       conn=ConnLimits.from_config(self.config),
                                       auto_ban_after=net.auto_ban_after or None,
                                       run_peers=self.config.run.role_peers)
        self.swarm.watch.listeners.append(self._libp2p_health)
        self.swarm.on_fatal = self.fail
        self.board.set_identity(key.peer_id, version=__version__, data_dir=str(self.data_dir),
                                listen_addrs=self.swarm.listen_addrs(), http_url=self.http_url)
        run = self.config.run
        self.board.set_run(run.run_id, model=run.model, dtype=run.dtype,
                           trainer_peer_id=run.trainer_peer_id or "", async_level=run.async_level)

        bulk_app = web.Application(client_max_size=1 << 20, middlewares=[send_deadline])
        ctl_app = control.control_app(self._token, status=self.status, stop=self.request_stop)
        for factory in self._factories:
            svc = factory(self)
            self.services.append(svc)
            self._by_class.setdefault(type(svc), svc)
            for rd in getattr(svc, "routes", lambda: [])():
                bulk_app.router.add_route(rd.method, rd.path, rd.handler)
            for rd in getattr(svc, "control_routes", lambda: [])():
                ctl_app.router.add_route(rd.method, rd.path, rd.handler)
        for app, sock in ((bulk_app, bulk_sock), (ctl_app, ctl_sock)):
            bulk = app is bulk_app  # open to every peer: bounded (blobs/server.py); control is loopback
            options: RunnerOptions = runner_kwargs(self.http_gate.limits) if bulk else {}
            runner = web.AppRunner(app, access_log=None, handle_signals=False, **options)
            await runner.setup()
            site = (GatedSite(runner, sock, self.http_gate, shutdown_timeout=2.0) if bulk
                    else web.SockSite(runner, sock, shutdown_timeout=2.0))
            await site.start()
            self._runners.append(runner)
        for svc in self.services:
            await svc.start()

        self.heartbeats = Heartbeats(self.swarm, interval=net.heartbeat_interval,
                                     peer_timeout=net.peer_timeout,
                                     stretch_above=net.heartbeat_stretch_above,
                                     max_interval=net.heartbeat_max_interval, spawn=self.spawn)
        self.heartbeats.start()
        if net.bootstrap or self.swarm.peerbook.remembered():
            reached = await self.swarm.bootstrap(list(net.bootstrap))
            if reached:  # the timeline's first peer, now rather than at the status loop's next second
                self.board.mark("first_peer")
            log.info("connected to %d of %d bootstrap peers", len(reached), len(net.bootstrap))
            if not reached and net.bootstrap:
                boot = list(net.bootstrap)
                self._bootstrap_task = self.spawn("bootstrap-retry", lambda: self._retry_bootstrap(boot),
                                                  essential=False, may_end=True)  # done once a peer is in
        self._status_task = self.spawn("status-peers", self._status_loop)
        gcpolicy.settle()  # what start-up built stays: later collections need not walk it
        control.write_control_file(self.data_dir, self.control_url, self._token)
        self.board.set_state("running")
        if self.notifier.enabled:
            self.notifier.ready(status="running")
            self.spawn("systemd-watchdog", self._watchdog_loop)
        ident = self.board.snapshot().identity
        log.info("node %s up: peers join with --bootstrap %s; metrics %s; http %s, control %s", key.peer_id,
                 ident.share_addr or "-", ident.metrics_url or "off", self.http_url, self.control_url)

    def _lock_data_dir(self) -> None:
        fd = os.open(self.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise ConfigError(f"another node is already running with --data-dir {self.data_dir}; stop it "
                              "or use another data dir", field="data_dir") from exc
        self._lock_fd = fd

    # -- status ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``GET /v1/status`` serves: identity, connected peers, peerbook, the status snapshot."""
        sw = self._swarm
        snap = self.board.snapshot()
        out: dict[str, Any] = {
            "peer_id": sw.peer_id if sw else "",
            "listen_addrs": sw.listen_addrs() if sw else [],
            "peers": sw.connected_peers() if sw else [],
            "http_url": self.http_url,
            "run_id": self.config.run.run_id,
            "roles": self.roles,
            "alive_peers": sw.peerbook.alive_peers() if sw else [],
            "known_peers": sw.peerbook.snapshot() if sw else [],
            "gossip": {"delivered": dict(sw.delivered), "dropped": dict(sw.dropped),
                       "ignored": dict(sw.ignored), "ignored_why": dict(sw.ignored_why)} if sw else {},
            "connections": ({**sw.connmgr.snapshot(len(sw.connected_peers())), "inbound": _inbound(sw)}
                            if sw else {}),
            "http": self.http_gate.stats(),
            "heartbeats": self.heartbeats.snapshot() if self.heartbeats else {},
            "snapshot": snap.to_dict(),
            "health": {"state": snap.state, "healthy": snap.healthy, "reasons": list(snap.health.reasons),
                       "restarts": dict(snap.health.restarts),
                       "warnings": [w.message for w in snap.warnings]},
        }
        for svc in self.services:
            fn = getattr(svc, "status", None)
            if callable(fn):
                out[getattr(svc, "name", type(svc).__name__)] = fn()
        return out

    async def _retry_bootstrap(self, addrs: list[str]) -> None:
        """Dial the bootstrap peers again until one answers or some peer connects to us (bounded)."""
        for attempt in range(BOOTSTRAP_RETRIES):
            await asyncio.sleep(BOOTSTRAP_RETRY_S[min(attempt, len(BOOTSTRAP_RETRY_S) - 1)])
            if self.swarm.connected_peers():
                return
            if await self.swarm.bootstrap(addrs):
                log.info("reached a bootstrap peer on attempt %d", attempt + 2)
                return
        log.warning("no bootstrap peer answered after %d attempts; waiting for peers to dial in",
                    BOOTSTRAP_RETRIES + 1)

    async def _status_loop(self) -> None:
        while True:
            sw = self._swarm
            if sw is not None:
                by_role: dict[str, list[str]] = {"trainer": [], "validator": [], "worker": []}
                for rec in sw.peerbook.snapshot():
                    if rec["state"] == "alive":
                        for r in rec["roles"]:
                            by_role.get(r, []).append(rec["peer_id"])
                count = len(sw.connected_peers())
                self.board.set_peers(count, trainers=by_role["trainer"],
                                     validators=by_role["validator"], workers=by_role["worker"])
                show_inbound(self.board, sw)
                self.board.set_gossip(refused=sum(sw.dropped.values()), stale=sw.ignored_why.get("stale", 0),
                                      repeat=sw.ignored_why.get("repeat", 0))
                self._note_peers(count)
                await asyncio.to_thread(sw.peerbook.save)  # fsync: keep it off the event loop
            self.board.refreshed()
            await asyncio.sleep(1.0)

    def _note_peers(self, count: int) -> None:
        now = time.monotonic()
        if count:
            self._alone_since = None
            self.board.set_degraded("peers", "")
            return
        if self._alone_since is None:
            self._alone_since = now
        alone = now - self._alone_since
        if alone >= NO_PEERS_DEGRADED_S:
            self.board.set_degraded("peers", f"no peers for {alone:.0f} s")

    async def _watchdog_loop(self) -> None:
        """systemd: ``WATCHDOG=1`` only while :meth:`problem` is empty; ``STATUS=`` when it changes."""
        period = self.notifier.watchdog_s / 2 if self.notifier.watchdog_s else WATCHDOG_PERIOD_S
        said = "running"
        while True:
            snap = self.board.snapshot()
            text = snap.state + (": " + "; ".join(snap.health.reasons) if snap.health.reasons else "")
            if text != said:  # before the ping: a reader of both sees the state the ping vouches for
                self.notifier.status(text)
                said = text
            if not self.problem() and self.notifier.watchdog_s:
                self.notifier.watchdog()
            await asyncio.sleep(period)

    # -- stop --------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_event.set()

    async def wait_stopped(self) -> None:
        await self._stop_event.wait()

    async def stop(self) -> None:
        """Undo :meth:`start` in reverse, each step bounded; safe to call twice."""
        self.notifier.stopping()
        self.board.set_state("stopping")
        self.supervisor.begin_close()
        control.remove_control_file(self.data_dir, self._token)
        for task in (self._status_task, self._bootstrap_task):
            if task is not None:
                task.cancel()
        if self.heartbeats is not None:
            await self.heartbeats.stop()
        for svc in reversed(self.services):
            try:
                await asyncio.wait_for(svc.close(), SERVICE_STOP_TIMEOUT_S)
            except Exception as exc:  # shutting down: log and go on with the rest
                log.warning("service %s did not close cleanly: %r", type(svc).__name__, exc)
        self.services = []
        self._by_class = {}
        for runner in self._runners:
            try:
                await asyncio.wait_for(runner.cleanup(), SERVICE_STOP_TIMEOUT_S)
            except Exception as exc:  # same: the process is on its way out
                log.warning("HTTP runner did not stop cleanly: %r", exc)
        self._runners = []
        await self.supervisor.close()  # whatever a service left running
        if self._swarm is not None:
            await self._swarm.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.board.set_state("stopped")


async def serve(runtime: NodeRuntime) -> None:
    """Start ``runtime``, run until SIGINT/SIGTERM or ``POST /v1/stop``, then stop it (bounded)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, runtime.request_stop)
    try:
        await runtime.start()
        await runtime.wait_stopped()
        log.info("stopping")
    finally:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(runtime.stop(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("shutdown took longer than %.0fs; exiting anyway", STOP_TIMEOUT_S)
        log.info("stopped in %.2fs", time.monotonic() - t0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def show_inbound(board: StatusBoard, sw: Swarm) -> None:
    """The inbound cap on the board: its numbers, and ``degraded`` while it is full (new peers refused)."""
    slots = sw.inbound()
    board.set_inbound(slots.in_use, slots.cap, slots.refused)
    board.set_degraded("inbound", (
        f"inbound connection cap full ({slots.in_use} of {slots.cap}): new peers are refused "
        f"({slots.refused} so far); raise network.conn_high") if slots.full else "")


def _inbound(sw: Swarm) -> dict[str, int]:
    slots = sw.inbound()
    return {"in_use": slots.in_use, "cap": slots.cap, "refused": slots.refused}


def run_node(runtime: NodeRuntime) -> int:
    """Run a node in this process until a signal; the process's exit code: 0 on a clean stop,
    :data:`EXIT_UNHEALTHY` when it stopped because a part could not be kept working."""
    asyncio.run(serve(runtime))
    return runtime.exit_code
