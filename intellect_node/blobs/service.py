"""The node's blob service: store + bulk HTTP routes + fetcher + DHT announcements + control routes.

One per node. The runtime builds it with :meth:`BlobService.from_swarm`, mounts :meth:`routes` on the
bulk HTTP app and :meth:`control_routes` on the token-protected control API, then calls
:meth:`start`; :meth:`close` on the way out. Without a swarm (tests, benchmarks, ``blob_peer``) it takes
plain callables for provider lookup and announcements.

Control API (JSON over the control app, which checks the token)::

    POST /v1/blob/put  {"path": "/abs/file", "name": null, "chunk_size": null}  -> {"cid", "size", "chunks"}
         with "progress": true -> NDJSON stream: {"event": "chunking", "bytes_done", "bytes_total"}*
            {"event": "announcing"} {"event": "done", "cid", "size", "chunks", "name"} or {"event": "error"}
    POST /v1/blob/get  {"cid": "...", "out": "/abs/file" | null}
         -> NDJSON stream: {"event": "manifest", ...} {"event": "chunk", ...}*
            {"event": "writing", "bytes_done", "bytes_total"}* (assembling --out, then its fsync)
            {"event": "done", ...} or a final {"event": "error", "message": ...}
         A client that goes away (Ctrl-C) ends the fetch; the chunks so far stay in the store.
    GET  /v1/blob/ls   -> {"blobs": [{"cid", "name", "size", "held", "complete", "publisher", "since"}],
                           "fetching": [cid, ...]}
    POST /v1/blob/rm   {"cid": "..."}  -> {"cid", "freed"}   (409 while that blob is being fetched)
    POST /v1/blob/gc   {"keep": [cid, ...], "older_than": unix_seconds}
         -> {"removed": [cid, ...], "orphans": n, "freed": bytes}   (blobs being fetched are kept too)

Which blobs to keep is one rule (``roles/common/pins.py``: the trainer's policy chain, and an hour's
age), applied by ``blob gc`` and, every :data:`GC_EVERY_S`, by the node itself (:meth:`collect_loop`,
started by ``node/assembly.py``); the node runs the removal so that it never races its own fetches and
serving (the store's index drops a blob before its files go).

Paths are resolved by the CLI (same machine, same user) so the node reads and writes files directly
instead of pushing 256 MiB through the control socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Sequence

from aiohttp import web

from intellect_node.aioutil import cancel_and_wait
from intellect_node.blobs.addresses import AddressPolicy
from intellect_node.blobs.fetch import ChunkSource, Fetcher, FetchStats, FindProviders, Progress, Provider
from intellect_node.blobs.http import HttpChunkSource, ServeStats, blob_routes
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import ConfigError, IntellectNodeError, ProtocolError
from intellect_node.protocol.blob import DEFAULT_CHUNK_SIZE, Manifest
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.signing import SigningKey

if TYPE_CHECKING:
    from intellect_node.config.status import StatusBoard
    from intellect_node.p2p.swarm import Swarm

log = logging.getLogger(__name__)

BLOBS_DIR = "blobs"
PUT_ANNOUNCE_WAIT_S = 20.0
"""``blob put`` through a running node returns once the provider record is out, or after this long."""
GC_EVERY_S = 600.0
"""How often a node removes the blobs it no longer keeps (:meth:`BlobService.collect_loop`): a fresh key's
notices can make the trainer and validators fetch batches nobody pins, and before this they stayed on
disk until an operator ran ``blob gc``."""
CLIENT_CHECK_S = 1.0
"""While a streamed request has nothing to say, how often it checks that its client is still there."""


async def _no_providers(cid: str) -> Sequence[Provider]:
    return []


async def _no_provide(cid: str) -> None:
    return None


class BlobService:
    name = "blobs"  # key of :meth:`status` in the node's status answer

    def __init__(self, store: BlobStore, key: SigningKey, *,
                 find_providers: FindProviders = _no_providers,
                 provide: Callable[[str], Awaitable[None]] = _no_provide,
                 penalise: Callable[[str, str], object] | None = None,
                 is_banned: Callable[[str], bool] | None = None,
                 board: StatusBoard | None = None, extra_sources: Sequence[ChunkSource] = (),
                 connect_timeout: float = 5.0, read_timeout: float = 15.0,
                 protect: Callable[[str, str], object] | None = None,
                 unprotect: Callable[[str, str], object] | None = None,
                 addresses: AddressPolicy | None = None) -> None:
        self.store = store
        self.addresses = addresses  # where providers' URLs may lead (blobs/addresses.py); None: anywhere
        self._hold = (protect, unprotect)  # the swarm's (peer, tag) protection while downloading
        self._timeouts = (connect_timeout, read_timeout)
        self.key = key
        self.serve_stats = ServeStats()
        self._find = find_providers
        self._provide = provide
        self._penalise = penalise
        self._is_banned = is_banned
        self._board = board
        self.extra_sources: tuple[ChunkSource, ...] = tuple(extra_sources)
        """Sources tried before HTTP (the NAT service's libp2p chunk stream for ``p2p://`` providers);
        every fetcher of this node's blobs takes them (``roles/common/fetch.HintedFetcher`` too)."""
        self._http: HttpChunkSource | None = None
        self._fetcher: Fetcher | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._provided: set[str] = set()
        self._fetching: dict[str, int] = {}  # cid -> fetches in flight: never removed under them
        self.collected = {"blobs": 0, "bytes": 0}
        """What :meth:`collect` removed since start (``blob gc`` and the node's own collection)."""

    @classmethod
    def from_swarm(cls, swarm: Swarm, data_dir: Path, *, board: StatusBoard | None = None,
                   extra_sources: Sequence[ChunkSource] = ()) -> "BlobService":
        """Wire to the swarm facade: DHT provider records, peerbook penalties, the node key."""
        book = swarm.peerbook
        return cls(BlobStore(data_dir / BLOBS_DIR), swarm.key, find_providers=swarm.find_providers,
                   provide=swarm.provide, penalise=book.record_rejection,
                   is_banned=getattr(book, "is_banned", None), board=board, extra_sources=extra_sources,
                   protect=getattr(swarm, "protect", None), unprotect=getattr(swarm, "unprotect", None),
                   addresses=AddressPolicy.from_swarm(swarm))

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, *, announce: bool = True) -> None:
        """Open the HTTP client and (re-)announce every blob held, complete or partial."""
        # Every remote read has a deadline: a frozen peer (SIGSTOP) keeps its sockets open and silent.
        self._http = HttpChunkSource(connect_timeout=self._timeouts[0], read_timeout=self._timeouts[1],
                                     addresses=self.addresses)
        sources: list[ChunkSource] = [*self.extra_sources, self._http]
        self._fetcher = Fetcher(self.store, sources, self._find, self_peer_id=self.key.peer_id,
                                penalise=self._penalise, is_banned=self._is_banned,
                                protect=self._hold[0], unprotect=self._hold[1])
        if announce:
            for cid in self.store.manifest_cids():
                self._announce(cid)

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        if self._http is not None:
            self._http.close()
            self._http = None
        await asyncio.to_thread(self.store.close)

    def announce(self, cid: str) -> None:
        """Provide ``cid`` in the DHT in the background, once (a blob fetched by other means than
        :meth:`fetch`, which announces by itself)."""
        self._announce(cid)

    def _announce(self, cid: str) -> asyncio.Task[None] | None:
        """Provide ``cid`` in the DHT in the background (about half a second per record); returns the
        task, or None when it was announced already."""
        if cid in self._provided:
            return None
        self._provided.add(cid)

        async def run() -> None:
            try:
                await self._provide(cid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the edge of a background task: log, let a later start retry
                self._provided.discard(cid)
                log.warning("could not announce blob %s: %s", cid, exc)

        return self._background(run())

    async def settle(self) -> None:
        """Wait for the background work started so far (DHT announcements, flushes)."""
        while pending := [t for t in self._tasks if not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    def _background(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def status(self) -> dict[str, object]:
        blobs = []
        for cid in self.store.manifest_cids():
            m = self.store.manifest(cid)
            assert m is not None
            missing = self.store.missing(cid)
            blobs.append({"cid": cid, "name": m.name, "size": m.total_size, "chunks": len(m.chunks),
                          "missing": len(missing)})
        return {"blobs": blobs, "served_chunks": self.serve_stats.chunks,
                "served_bytes": self.serve_stats.bytes, "collected": dict(self.collected)}

    # -- library API ----------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        return blob_routes(self.store, self.serve_stats)

    async def put_file(self, path: str | Path, *, name: str | None = None,
                       chunk_size: int = DEFAULT_CHUNK_SIZE, wait_announced: float = 0.0,
                       announce_min_chunks: int = 0,
                       on_bytes: Callable[[int, int], None] | None = None) -> tuple[str, Manifest]:
        """Add a file as a blob and announce it; with ``wait_announced`` > 0, return once the DHT
        provider record is out (or that many seconds passed; the announcement goes on regardless).
        A blob of fewer than ``announce_min_chunks`` chunks is not announced: for the roles' small blobs
        (a rollout batch, a policy delta) every fetcher is told the holder by the message that names the
        blob, and a provider record would cost a DHT lookup here and a request at every close peer.
        ``on_bytes(done, total)`` runs on the event loop as chunks are stored."""
        cid, m = await asyncio.to_thread(self.store.add_file, path, self.key, name=name,
                                         chunk_size=chunk_size, on_bytes=_on_loop(on_bytes))
        announcing = self._announce(cid) if len(m.chunks) >= announce_min_chunks else None
        if self._board is not None:
            self._board.shard_done(cid, new_bytes=0)
        if announcing is not None and wait_announced > 0:
            # A caller that prints the CID expects others to find it right away: wait for the record.
            await asyncio.wait({announcing}, timeout=wait_announced)
        return cid, m

    async def fetch(self, cid: str, *, out: str | Path | None = None,
                    on_progress: Callable[[Progress], None] | None = None,
                    on_manifest: Callable[[Manifest], None] | None = None,
                    on_write: Callable[[int, int], None] | None = None) -> FetchStats:
        """Fetch a blob into the store (serving and announcing it while it arrives); optionally write it
        out as one file, reporting ``on_write(done, total)`` (on the loop) while it is assembled."""
        validate_cid(cid)
        if self._fetcher is None:
            raise RuntimeError("BlobService.start() was not called")
        fetcher = self._fetcher
        name = ""

        def manifest_seen(m: Manifest) -> None:
            nonlocal name
            name = m.name
            if on_manifest is not None:
                on_manifest(m)  # may refuse the blob (raises): then it is not announced
            self._announce(cid)  # partial holders serve what they have: swarm from the first chunk

        def progress(p: Progress) -> None:
            if self._board is not None:
                self._board.shard_progress(cid, name, p.bytes_done, p.bytes_total, new_bytes=p.chunk_bytes)
            if on_progress is not None:
                on_progress(p)

        self._fetching[cid] = self._fetching.get(cid, 0) + 1
        try:
            stats = await fetcher.fetch(cid, on_progress=progress, on_manifest=manifest_seen)
        finally:
            if self._fetching[cid] == 1:
                del self._fetching[cid]
            else:
                self._fetching[cid] -= 1
            self._background(asyncio.to_thread(self.store.flush))  # batch fsync, off the transfer path
        if self._board is not None:
            self._board.shard_done(cid, new_bytes=0)
        if out is not None:
            await asyncio.to_thread(self.store.export, cid, out, _on_loop(on_write))
        return stats

    # -- control API ----------------------------------------------------------------------------

    def control_routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/blob/put", self._ctl_put), web.post("/v1/blob/get", self._ctl_get),
                web.get("/v1/blob/ls", self._ctl_ls), web.post("/v1/blob/rm", self._ctl_rm),
                web.post("/v1/blob/gc", self._ctl_gc)]

    async def _ctl_ls(self, _request: web.Request) -> web.StreamResponse:
        blobs = [self.store.blob_info(cid) for cid in self.store.manifest_cids()]
        return web.json_response({"blobs": blobs, "fetching": sorted(self._fetching)})

    async def _ctl_rm(self, request: web.Request) -> web.StreamResponse:
        raw = (await self._json(request)).get("cid")
        cid = raw if isinstance(raw, str) else ""
        try:
            validate_cid(cid)
        except ProtocolError as exc:
            raise web.HTTPBadRequest(text=f"'cid' is not a blob CID: {exc}") from exc
        if cid in self._fetching:
            raise web.HTTPConflict(text=f"blob {cid} is being fetched; remove it when the fetch ended")
        try:
            freed = await asyncio.to_thread(self.store.remove_blob, cid)
        except ConfigError as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        self._provided.discard(cid)  # held again later (a new fetch): announce it again
        return web.json_response({"cid": cid, "freed": freed})

    async def _ctl_gc(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        keep, older_than = body.get("keep"), body.get("older_than")
        if not (isinstance(keep, list) and all(isinstance(c, str) for c in keep)
                and isinstance(older_than, (int, float))):
            raise web.HTTPBadRequest(text="expected {'keep': [cid, ...], 'older_than': unix seconds}")
        removed, orphans, freed = await self.collect(set(keep), older_than=float(older_than))
        return web.json_response({"removed": removed, "orphans": orphans, "freed": freed})

    async def collect(self, keep: set[str], *, older_than: float) -> tuple[list[str], int, int]:
        """Remove every blob not in ``keep``, not being fetched, whose manifest arrived before
        ``older_than`` (unix seconds), and the orphan chunks older than that (``BlobStore.gc``)."""
        removed, orphans, freed = await asyncio.to_thread(
            self.store.gc, keep | set(self._fetching), older_than=older_than)
        self._provided.difference_update(removed)  # held again later (a new fetch): announce it again
        self.collected["blobs"] += len(removed)
        self.collected["bytes"] += freed
        return removed, orphans, freed

    async def collect_loop(self, pins: Callable[[], Iterable[str]], *, min_age: float,
                           every: float | None = None) -> None:
        """Every ``every`` s (:data:`GC_EVERY_S`): :meth:`collect` what is not in ``pins()`` and older
        than ``min_age`` s.
        A ``pins`` that raises ConfigError (the trainer's state unreadable) skips the round: nothing is
        removed while what to keep is unknown. Run it under the runtime's supervision."""
        while True:
            await asyncio.sleep(GC_EVERY_S if every is None else every)
            try:
                keep = set(pins())
            except ConfigError as exc:
                log.warning("blob collection skipped: %s", exc)
                continue
            removed, orphans, freed = await self.collect(keep, older_than=time.time() - min_age)
            if removed or orphans:
                log.info("collected %d blob(s) and %d orphan chunk(s) older than %.0f s: %d bytes freed",
                         len(removed), orphans, min_age, freed)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise web.HTTPBadRequest(text=f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="body must be a JSON object")
        return body

    async def _ctl_put(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        path = body.get("path")
        if not isinstance(path, str) or not Path(path).is_absolute():
            raise web.HTTPBadRequest(text="'path' must be an absolute path")
        chunk_size = body.get("chunk_size") or DEFAULT_CHUNK_SIZE
        name = body.get("name") or None
        if body.get("progress") is True:
            return await self._ctl_put_stream(request, path, name, int(chunk_size))
        try:
            cid, m = await self.put_file(path, name=name, chunk_size=int(chunk_size),
                                         wait_announced=PUT_ANNOUNCE_WAIT_S)
        except (ConfigError, ProtocolError, OSError) as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc
        return web.json_response({"cid": cid, "size": m.total_size, "chunks": len(m.chunks), "name": m.name})

    async def _ctl_put_stream(self, request: web.Request, path: str, name: str | None,
                              chunk_size: int) -> web.StreamResponse:
        """``blob put`` with progress: chunking a large file and announcing it take minutes together."""
        queue: asyncio.Queue[dict[str, object]] = asyncio.Queue()

        def on_bytes(done: int, total: int) -> None:
            queue.put_nowait({"event": "chunking", "bytes_done": done, "bytes_total": total})
            if done == total:
                queue.put_nowait({"event": "announcing"})

        async def run() -> dict[str, object]:
            try:
                cid, m = await self.put_file(path, name=name, chunk_size=chunk_size,
                                             wait_announced=PUT_ANNOUNCE_WAIT_S, on_bytes=on_bytes)
            except (ConfigError, ProtocolError, OSError) as exc:
                return {"event": "error", "message": str(exc)}
            return {"event": "done", "cid": cid, "size": m.total_size, "chunks": len(m.chunks),
                    "name": m.name}

        return await _ndjson(request, queue, run(), f"blob put of {path}")

    async def _ctl_get(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        raw = body.get("cid")
        cid = raw if isinstance(raw, str) else ""
        out = body.get("out")
        try:
            validate_cid(cid)
        except ProtocolError as exc:
            raise web.HTTPBadRequest(text=f"'cid' is not a blob CID: {exc}") from exc
        if out is not None and (not isinstance(out, str) or not Path(out).is_absolute()):
            raise web.HTTPBadRequest(text="'out' must be an absolute path or null")
        queue: asyncio.Queue[dict[str, object]] = asyncio.Queue()

        def on_manifest(m: Manifest) -> None:
            queue.put_nowait({"event": "manifest", "name": m.name, "publisher": m.publisher,
                              "bytes_total": m.total_size, "chunks_total": len(m.chunks),
                              "chunks_done": len(m.chunks) - len(self.store.missing(cid)),
                              "bytes_done": m.total_size - sum(m.chunk_length(i)
                                                               for i in self.store.missing(cid))})

        def on_progress(p: Progress) -> None:
            queue.put_nowait({"event": "chunk", "index": p.index, "provider": p.provider,
                              "chunks_done": p.chunks_done, "chunks_total": p.chunks_total,
                              "bytes_done": p.bytes_done, "bytes_total": p.bytes_total})

        def on_write(done: int, total: int) -> None:
            queue.put_nowait({"event": "writing", "out": out, "bytes_done": done, "bytes_total": total})

        async def run() -> dict[str, object]:
            try:
                stats = await self.fetch(cid, out=out, on_progress=on_progress, on_manifest=on_manifest,
                                         on_write=on_write)
            except IntellectNodeError as exc:
                return {"event": "error", "message": str(exc)}
            except OSError as exc:
                return {"event": "error", "message": f"cannot write {out}: {exc}"}
            return {"event": "done", "out": out, "chunks_fetched": stats.chunks_fetched,
                    "chunks_resumed": stats.chunks_resumed, "bytes_fetched": stats.bytes_fetched,
                    "seconds": round(stats.seconds, 3), "bad_providers": stats.bad,
                    "providers": stats.by_provider}

        return await _ndjson(request, queue, run(), f"blob get of {cid}")


def _on_loop(fn: Callable[[int, int], None] | None) -> Callable[[int, int], None] | None:
    """``fn`` made callable from a worker thread: it runs on the calling event loop instead."""
    if fn is None:
        return None
    loop = asyncio.get_running_loop()

    def call(done: int, total: int) -> None:
        loop.call_soon_threadsafe(fn, done, total)

    return call


async def _ndjson(request: web.Request, queue: asyncio.Queue[dict[str, object]],
                  work: Awaitable[dict[str, object]], what: str) -> web.StreamResponse:
    """Stream ``queue``'s events as NDJSON while ``work`` runs, then its result as the last line.

    A client that goes away (Ctrl-C on ``blob get``) is the operator's choice, not a fault: the work is
    cancelled (chunks fetched so far stay in the store) and one INFO line says so, where aiohttp would
    log a traceback at ERROR for the failed write."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    task = asyncio.ensure_future(work)
    try:
        await resp.prepare(request)
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, timeout=CLIENT_CHECK_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:  # quiet (a provider lookup): notice a client that left without a write failing
                getter.cancel()
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("connection closed while the node was silent")
                continue
            if getter in done:
                await resp.write((json.dumps(getter.result()) + "\n").encode())
                continue
            getter.cancel()
            while not queue.empty():
                await resp.write((json.dumps(queue.get_nowait()) + "\n").encode())
            await resp.write((json.dumps(task.result()) + "\n").encode())
            break
        await resp.write_eof()
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
        log.info("%s ended: the client went away (%s)", what, exc)
    finally:
        if not task.done():  # the client went away: stop the work (chunks so far are kept)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return resp
