"""The node's reachability service: AutoNAT, then relay service (public) or relay client (private),
DCUtR, and chunk transfer over libp2p for private providers. Plugged in with ``runtime.add_service``.

Life of a node:

1. It serves AutoNAT dial-backs and DCUtR from the start and asks up to ``nat.autonat_servers``
   connected peers whether they reach it, every ``nat.check_interval`` s (sooner while UNKNOWN).
2. PUBLIC: it starts the circuit relay v2 service (unless ``nat.relay_service = "off"``) and announces
   it in the DHT.
3. PRIVATE: it reserves slots with ``nat.relays_wanted`` relays found through the DHT, advertises the
   circuit addresses instead of its unreachable direct ones, and advertises ``p2p://<peer id>`` as its
   blob URL: peers then fetch its chunks over libp2p (:class:`P2PChunkSource`), through the relay or a
   punched connection, with the same hash checks.

Everything libp2p runs on the trio thread (``swarm.bridge``); ``status()`` reads a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import trio
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID

from intellect_node.errors import ChunkUnavailable, IntegrityError, TransportError
from intellect_node.p2p.compat import push_identify
from intellect_node.p2p.nat.autonat import DialBackAutoNAT, Reachability, ReachabilityReport, fix_text
from intellect_node.p2p.nat.chunk_stream import MAX_HAVE_BYTES, ChunkStreamClient, ChunkStreamServer
from intellect_node.p2p.nat.dcutr import HolePuncher
from intellect_node.p2p.nat.relay import (
    CircuitDialer,
    RelayClient,
    RelayService,
    RelayServiceLimits,
    advertise_circuit_addrs,
    connection_kinds,
)
from intellect_node.protocol.gossip import P2P_URL_PREFIX  # the blob URL a private node advertises

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig
    from intellect_node.config.nat import NatConfig
    from intellect_node.config.status import StatusBoard
    from intellect_node.p2p.swarm import Swarm

log = logging.getLogger(__name__)


class _Node(Protocol):
    """What :meth:`NatService.for_runtime` reads of the node (``node.runtime.NodeRuntime``)."""

    @property
    def swarm(self) -> Swarm: ...

    @property
    def config(self) -> NodeConfig: ...

    @property
    def board(self) -> StatusBoard: ...


class _Sink(Protocol):
    """Where a chunk read over libp2p goes (the fetcher's ``ChunkWriter``: ``blobs/http.py``'s
    ``ChunkSink``)."""

    def write(self, data: bytes) -> object: ...

UNKNOWN_CHECKS_BEFORE_RELAYING = 3
"""AutoNAT rounds without a verdict (with peers asked) after which the node reserves relay slots anyway."""


IDENTIFY_PUSH_TIMEOUT_S = 10.0
"""Bound on one identify push to all connected peers (a peer that does not answer must not hold it)."""

FIRST_CHECK_RETRY_S = 3.0
"""First re-check interval while the verdict is UNKNOWN (too few peers answered yet); it doubles up to
``nat.check_interval``."""


class HeldBlobs(Protocol):
    """What the chunk server reads of the blob store (``blobs/store.py``'s ``BlobStore``, a layer above)."""

    def manifest_bytes(self, cid: str) -> bytes | None: ...

    def have_bytes(self, cid: str) -> bytes | None: ...

    def has_chunk(self, cid: str) -> bool: ...

    def chunk_path(self, cid: str) -> Path: ...


class NatService:
    """``runtime.add_service(NatService.for_runtime)``; see the module docstring."""

    name = "nat"

    def __init__(self, swarm: Swarm, config: NatConfig, *,
                 blob_store: Callable[[], HeldBlobs | None] = lambda: None,
                 on_reject: Callable[[str, str], object] | None = None,
                 board: StatusBoard | None = None, client_only: bool = False) -> None:
        self.swarm = swarm
        self.cfg = config
        self.client_only = client_only
        """True for a short-lived lookup (``roles/runs.client_swarm``): it only dials out, so it asks no
        peer for dial-backs, reserves no relay and relays for nobody; it keeps the dialler, DCUtR and the
        chunk stream, so it can fetch from ``p2p://`` providers through their relays."""
        self.board = board
        self._blob_store = blob_store
        self._on_reject = on_reject
        self.report = ReachabilityReport(status=Reachability.UNKNOWN).with_fix()
        self.relay_service: RelayService | None = None
        self.relay_client: RelayClient | None = None
        self.puncher: HolePuncher | None = None
        self.dialer: CircuitDialer | None = None
        self.chunk_server: ChunkStreamServer | None = None
        self.autonat: DialBackAutoNAT | None = None
        self.source = P2PChunkSource(self)
        self._public_url = swarm.http_url
        self._task: asyncio.Task[None] | None = None
        self._nursery: trio.Nursery | None = None
        self.checks = 0
        self._unknown_checks = 0
        self.time_to_reachability_s: float | None = None
        self._t0 = time.monotonic()
        self._push_pending = False

    @classmethod
    def for_runtime(cls, rt: _Node) -> "NatService":
        return cls(rt.swarm, rt.config.nat, on_reject=rt.swarm.peerbook.record_rejection, board=rt.board)

    def attach_blob_store(self, get_store: Callable[[], HeldBlobs | None]) -> None:
        """Where served chunks come from (the blob service's store, known once it is built)."""
        self._blob_store = get_store

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.cfg.enabled:
            return
        if self._reattach not in self.swarm.on_restart:  # its trio state dies with a libp2p restart
            self.swarm.on_restart.append(self._reattach)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def ready() -> None:
            if not started.done():
                started.set_result(None)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._start_trio(nursery)
                loop.call_soon_threadsafe(ready)
                if self.client_only:
                    await trio.sleep_forever()
                await self._check_loop()

        self._task = asyncio.create_task(self.swarm.bridge.call(main), name="nat")
        done, _ = await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            self._task.result()  # raises what went wrong at start

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception) as exc:  # closing: report, never raise
                if not isinstance(exc, asyncio.CancelledError):
                    log.debug("nat service stopped with %r", exc)
            self._task = None

    async def _reattach(self) -> None:
        """``swarm.on_restart``: libp2p was restarted on a new host; serve and check again on it."""
        await self.close()
        await self.start()

    # -- trio side -----------------------------------------------------------------------------------

    @property
    def host(self) -> BasicHost:
        host = self.swarm.p2p.host
        if not isinstance(host, BasicHost):  # new_host builds one; AutoNAT and the relay need its API
            raise TypeError(f"the NAT service needs libp2p's BasicHost, not {type(host).__name__}")
        return host

    async def _start_trio(self, nursery: trio.Nursery) -> None:
        host = self.host
        self.autonat = DialBackAutoNAT(host, serve=True, on_reject=self._on_reject)
        self.dialer = CircuitDialer(host)
        self.chunk_server = ChunkStreamServer(host, self._lookup, relay_limits=self._relay_limit,
                                              on_reject=self._on_reject)
        self.chunk_server.register()
        if self.cfg.hole_punching:
            self.puncher = HolePuncher(host)
            await nursery.start(self.puncher.run)
        if self.cfg.relay_service == "on" and not self.client_only:
            await self._start_relay_service()

    async def _check_loop(self) -> None:
        retry = FIRST_CHECK_RETRY_S
        while True:
            await self._ensure_servers()
            servers = self._autonat_servers()
            if servers:
                await self._check(servers)
            if self.report.status is Reachability.UNKNOWN:
                # No verdict yet: ask again soon, backing off so a node whose peers do not answer does
                # not keep asking every few seconds (each answer costs the asked peer a dial-back).
                await trio.sleep(retry)
                retry = min(retry * 2, self.cfg.check_interval)
            else:
                retry = FIRST_CHECK_RETRY_S
                await trio.sleep(self.cfg.check_interval)

    async def _ensure_servers(self) -> None:
        """Connect to peers we hear (heartbeats) until enough AutoNAT servers are connected: a node
        that knows only its bootstrap peer could otherwise never collect enough answers."""
        need = self.cfg.autonat_confirmations - len(self._autonat_servers())
        if need <= 0:
            return
        connected = {p.to_base58() for p in self.host.get_connected_peers()}
        for peer in self.swarm.peerbook.alive_peers():
            if need <= 0:
                return
            if peer in connected or peer == self.swarm.peer_id:
                continue
            addrs = [a for a in self.swarm.peerbook.addrs(peer) if "/p2p-circuit" not in a]
            if not addrs:
                continue
            try:
                assert self.dialer is not None
                await self.dialer.connect_addrs(addrs, timeout=5.0)
                need -= 1
            except Exception as exc:  # unreachable peer: try the next one
                log.debug("could not reach %s for AutoNAT: %s", peer, exc)

    def _autonat_servers(self) -> list[ID]:
        from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID

        store = self.host.get_peerstore()
        out = []
        for peer in self.host.get_connected_peers():
            # Only peers we reach directly: a server refuses requests that arrive through a relay (the
            # spec), and a private peer reached through its relay cannot dial anyone back anyway.
            if "direct" not in connection_kinds(self.host, peer):
                continue
            try:
                if store.supports_protocols(peer, [str(AUTONAT_PROTOCOL_ID)]):
                    out.append(peer)
            except Exception:  # not identified yet
                continue
        # Servers that answered last time first: a connection whose streams stall would otherwise be
        # asked again every round and hold the verdict back (seen with full nodes in namespaces).
        unanswered = self.autonat.unanswered if self.autonat is not None else {}
        out.sort(key=lambda p: unanswered.get(p, 0))
        return out[: self.cfg.autonat_servers]

    async def _check(self, servers: list[ID]) -> None:
        assert self.autonat is not None
        relayed = self.relay_client is not None and bool(self.relay_client.held)
        report = await self.autonat.check(servers, min_confirmations=self.cfg.autonat_confirmations,
                                          relayed=relayed)
        self.checks += 1
        if report.status is Reachability.UNKNOWN:
            self._unknown_checks += 1
            if (self._unknown_checks >= UNKNOWN_CHECKS_BEFORE_RELAYING and self.relay_client is None
                    and self.report.status is not Reachability.PUBLIC):
                # No verdict after several rounds (peers that cannot dial us back often cannot answer
                # in time either): hold relay reservations anyway, as insurance. The node keeps
                # advertising its own addresses too until AutoNAT says PRIVATE.
                log.info("no reachability verdict after %d checks: reserving relay slots anyway",
                         self._unknown_checks)
                await self._start_relay_client()
        else:
            self._unknown_checks = 0
        if report.status is Reachability.UNKNOWN and self.report.status is not Reachability.UNKNOWN:
            return  # keep the last verdict until a new one is reached
        changed = report.status is not self.report.status
        if changed:
            log.info("reachability: %s (%s)", report.status.value, report.fix)
        self.report = report
        if changed:
            self._addrs_changed()  # PRIVATE advertises only circuit addresses (relay.advertise_circuit_addrs)
        if report.status is Reachability.PUBLIC:
            if self.cfg.relay_service == "auto" and self.relay_service is None:
                await self._start_relay_service()
            self._set_blob_url(private=False)
            if self.time_to_reachability_s is None:
                self.time_to_reachability_s = time.monotonic() - self._t0
        elif report.status is Reachability.PRIVATE:
            if self.relay_client is None:
                await self._start_relay_client()
        self._publish()

    def _publish(self) -> None:
        """Hand the verdict to the status board (dashboard, ``status``, ``doctor``) on the asyncio side."""
        board = self.board
        if board is None:
            return
        st = self.status()
        kind = st["reachability"].lower()
        relays = [r["relay"] for r in st.get("relays", [])]
        if kind == "private" and relays:
            kind = "relayed"
        self.swarm.bridge.to_asyncio(lambda: board.set_reachability(
            kind, public_addrs=st["public_addrs"], relay=relays[0] if relays else "", detail=st["fix"]))

    async def _start_relay_service(self) -> None:
        assert self._nursery is not None
        c = self.cfg
        self.relay_service = RelayService(self.host, self.swarm.p2p, RelayServiceLimits(
            max_reservations=c.relay_max_reservations, max_circuits=c.relay_max_circuits,
            max_circuits_total=c.relay_max_circuits_total, max_bytes=c.relay_max_bytes,
            max_duration_s=c.relay_max_duration, reservation_ttl_s=c.relay_reservation_ttl))
        await self._nursery.start(self.relay_service.run)
        log.info("serving as a circuit relay")
        self._addrs_changed()  # peers connected earlier learn that we now speak HOP

    async def _start_relay_client(self) -> None:
        assert self._nursery is not None

        def changed() -> None:
            held = bool(self.relay_client and self.relay_client.held)
            self._set_blob_url(private=held and self.report.status is not Reachability.PUBLIC)
            self.report = replace(self.report, relayed=held).with_fix()
            self._addrs_changed()
            self._publish()

        # swarm.p2p's provider walk, not KadDHT.find_providers (which answers from its cache once it
        # holds any record, so relays that appear later would never be found).
        self.relay_client = RelayClient(self.host, self.swarm.p2p, want=self.cfg.relays_wanted,
                                        static_relays=self.cfg.static_relays, on_change=changed,
                                        check_interval_s=self.cfg.relay_check_interval)
        advertise_circuit_addrs(self.host, self.relay_client.circuit_addrs,
                                private=lambda: self.report.status is Reachability.PRIVATE)
        await self._nursery.start(self.relay_client.run)

    def _addrs_changed(self) -> None:
        """Our advertised addresses or protocols changed: refresh the host's address snapshot now
        (``status`` reads it; it is otherwise refreshed every few seconds) and tell connected peers with
        identify push, as go-libp2p does, so they learn our circuit addresses, or that we relay (private
        nodes look for relays among connected peers first), without waiting for a reconnect."""
        p2p = self.swarm.p2p
        p2p.addrs_snapshot = p2p.listen_addrs()
        if self._nursery is not None and not self._push_pending:
            self._push_pending = True
            self._nursery.start_soon(self._push_identify)

    async def _push_identify(self) -> None:
        await trio.sleep(0)  # several changes in one tick make one push
        self._push_pending = False
        with trio.move_on_after(IDENTIFY_PUSH_TIMEOUT_S):
            await push_identify(self.host)  # best effort: it never raises

    def _set_blob_url(self, *, private: bool) -> None:
        url = f"{P2P_URL_PREFIX}{self.swarm.peer_id}" if private else self._public_url
        if self.swarm.http_url != url:
            self.swarm.http_url = url
            if private and self.time_to_reachability_s is None:
                self.time_to_reachability_s = time.monotonic() - self._t0
            log.info("advertising blob URL %s", url)

    def _relay_limit(self, relay: str) -> int | None:
        return self.relay_client.data_limit(relay) if self.relay_client is not None else None

    async def _lookup(self, kind: str, cid: str) -> bytes | None:
        store = self._blob_store()
        if store is None:
            return None
        if kind == "manifest":
            return store.manifest_bytes(cid)
        if kind == "have":
            return store.have_bytes(cid)
        if not store.has_chunk(cid):
            return None
        return await trio.to_thread.run_sync(store.chunk_path(cid).read_bytes)

    # -- status --------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        r = self.report
        relayed = self.relay_client is not None and bool(self.relay_client.held)
        out: dict[str, Any] = {
            "reachability": r.status.value,
            "fix": fix_text(r.status, r.listen_port, relayed),
            "public_addrs": list(r.public_addrs),
            "checked_peers": {"reached": r.successes, "failed": r.failures, "no_verdict": r.no_verdict},
            "checks": self.checks,
            "blob_url": self.swarm.http_url,
            "time_to_reachability_s": self.time_to_reachability_s,
        }
        if self.relay_client is not None:
            snap = self.relay_client.snapshot()
            out["relays"] = [{"relay": h.relay, "expires_in_s": round(h.expires_at - time.time(), 1),
                              "data_limit": h.data_limit} for h in snap.reservations]
            out["circuit_addrs"] = list(snap.circuit_addrs)
            out["renewals"] = snap.renewals
            out["relays_lost"] = snap.lost
        if self.relay_service is not None:
            s = self.relay_service.snapshot()
            out["relay_service"] = {"reservations": s.reservations, "circuits": s.active_circuits,
                                    "refused_circuits": s.refused_circuits, "announced": s.advertised}
        if self.puncher is not None:
            p = self.puncher.snapshot()
            out["hole_punch"] = {"attempts": p.attempts, "direct": p.direct, "failed": p.failed}
        if self.chunk_server is not None:
            out["chunk_stream"] = {"served_bytes": self.chunk_server.served_bytes,
                                   "refused_relay_budget": self.chunk_server.refused_budget,
                                   "refused_busy": self.chunk_server.refused_busy,
                                   "serving_bytes": self.chunk_server.serving_bytes}
        return out


class P2PChunkSource:
    """A blob :class:`~intellect_node.blobs.fetch.ChunkSource` for ``p2p://`` providers (private
    nodes): connects through their circuit addresses (then DCUtR may punch through) and pulls over
    ``/intellect/blob-chunk/1.0.0``."""

    def __init__(self, nat: NatService) -> None:
        self.nat = nat

    def accepts(self, provider: object) -> bool:
        return str(getattr(provider, "http_url", "") or "").startswith(P2P_URL_PREFIX)

    async def _get(self, provider: object, kind: str, cid: str, max_size: int) -> bytes:
        peer = str(getattr(provider, "peer_id"))

        async def fetch() -> bytes | None:
            nat = self.nat
            if nat.dialer is None:
                raise TransportError("the NAT service is not running")
            pid = ID.from_base58(peer)
            if not connection_kinds(nat.host, pid):
                # The DHT provider walk stored the provider's advertised (circuit) addresses in the
                # peerstore; heartbeats carry them too.
                addrs = [str(a) for a in nat.host.get_peerstore().addrs(pid)] + nat.swarm.peerbook.addrs(peer)
                full = [a if a.endswith(f"/p2p/{peer}") else f"{a}/p2p/{peer}" for a in dict.fromkeys(addrs)]
                if not full:
                    raise TransportError(f"no address known for {peer}")
                await nat.dialer.connect_addrs(full)
            return await ChunkStreamClient(nat.host, pid).get(kind, cid, max_size=max_size)

        data = await self.nat.swarm.bridge.call(fetch)
        if data is None:
            raise ChunkUnavailable(f"{peer} does not hold {kind} {cid}")
        return data

    async def get_manifest(self, provider: object, cid: str) -> bytes:
        return await self._get(provider, "manifest", cid, 1 << 20)

    async def get_have(self, provider: object, manifest_cid: str) -> bytes:
        return await self._get(provider, "have", manifest_cid, MAX_HAVE_BYTES)

    async def read_chunk(self, provider: object, cid: str, length: int, sink: _Sink) -> None:
        """Into ``sink`` (the fetcher's ChunkWriter: ``write``, hash-checked at commit); the chunk
        stream has already checked the bytes against ``cid``."""
        data = await self._get(provider, "chunk", cid, length)
        if len(data) != length:
            raise IntegrityError(f"chunk {cid} has {len(data)} bytes, the manifest says {length}")
        sink.write(data)
