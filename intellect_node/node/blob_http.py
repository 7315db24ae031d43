"""Bulk blob bytes over HTTP (aiohttp): the server routes and the client-side chunk source.

Routes (mounted on the node's bulk HTTP app, see :func:`blob_routes`)::

    GET /blob/v1/manifest/<blob-cid>   signed manifest envelope bytes
    GET /blob/v1/chunk/<chunk-cid>     the chunk's bytes (sendfile from the chunk file, zero-copy)
    GET /blob/v1/have/<blob-cid>       msgpack ``Have`` bitmap of the chunks this node holds

HTTP rather than libp2p streams because a TCP + Noise + Yamux stream measured about 13x slower than
plain TCP here (../shared/notes/libp2p-0.8.1.md). Nothing served needs trust: chunks are checked
against their CID and manifests against their CID and signature by the receiver.

:class:`HttpChunkSource` is the default :class:`~intellect_node.node.blob_fetch.ChunkSource`: it reads
responses piece by piece into the receiver's sink, so no chunk is buffered whole in memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from aiohttp import web

from intellect_node.errors import IntegrityError, ProtocolError, TransportError
from intellect_node.node.blobs import BlobStore
from intellect_node.protocol.blob import HTTP_PREFIX, MAX_CHUNK_SIZE, MAX_HAVE_SIZE, \
    MAX_MANIFEST_ENVELOPE_SIZE
from intellect_node.protocol.ids import validate_cid

OCTET = "application/octet-stream"


class ChunkUnavailable(TransportError):
    """The provider does not hold that chunk (HTTP 404): ask someone else, no penalty."""


@dataclass
class ServeStats:
    """Counters of what this node served (status, /metrics and tests read them)."""

    chunks: int = 0
    bytes: int = 0
    requests_by_cid: dict[str, int] = field(default_factory=dict)


def blob_routes(store: BlobStore, stats: ServeStats | None = None) -> list[web.RouteDef]:
    """The three GET routes of the blob protocol, serving from ``store``."""
    stats = stats if stats is not None else ServeStats()

    def _cid(request: web.Request) -> str:
        try:
            return validate_cid(request.match_info["cid"])
        except ProtocolError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc

    async def get_manifest(request: web.Request) -> web.StreamResponse:
        raw = store.manifest_bytes(_cid(request))
        if raw is None:
            raise web.HTTPNotFound(text="unknown manifest")
        return web.Response(body=raw, content_type=OCTET)

    async def get_have(request: web.Request) -> web.StreamResponse:
        raw = store.have_bytes(_cid(request))
        if raw is None:
            raise web.HTTPNotFound(text="unknown manifest")
        return web.Response(body=raw, content_type=OCTET)

    async def get_chunk(request: web.Request) -> web.StreamResponse:
        cid = _cid(request)
        if not store.has_chunk(cid):
            raise web.HTTPNotFound(text="chunk not held")
        path = store.chunk_path(cid)
        stats.chunks += 1
        stats.bytes += path.stat().st_size
        stats.requests_by_cid[cid] = stats.requests_by_cid.get(cid, 0) + 1
        # FileResponse sends with loop.sendfile (zero-copy); chunk files are immutable once renamed in.
        return web.FileResponse(path, headers={"Content-Type": OCTET, "Cache-Control": "immutable"})

    return [
        web.get(f"{HTTP_PREFIX}/manifest/{{cid}}", get_manifest),
        web.get(f"{HTTP_PREFIX}/have/{{cid}}", get_have),
        web.get(f"{HTTP_PREFIX}/chunk/{{cid}}", get_chunk),
    ]


READ_PIECE = 1 << 20
"""Largest piece handed to the sink per read; bigger pieces mean fewer Python-level iterations."""


class HttpChunkSource:
    """Fetch manifests, bitmaps and chunks from a provider's advertised ``http_url``."""

    def __init__(self, session: aiohttp.ClientSession, *, connect_timeout: float = 5.0,
                 read_timeout: float = 15.0) -> None:
        # Split by phase: a dead peer fails the connect fast; a frozen one (SIGSTOP) fails the read.
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                              sock_read=read_timeout)

    def accepts(self, provider: object) -> bool:
        return bool(getattr(provider, "http_url", None))

    def _url(self, provider: object, kind: str, cid: str) -> str:
        base = str(getattr(provider, "http_url")).rstrip("/")
        return f"{base}{HTTP_PREFIX}/{kind}/{cid}"

    async def _small(self, provider: object, kind: str, cid: str, limit: int) -> bytes:
        try:
            async with self._session.get(self._url(provider, kind, cid), timeout=self._timeout) as r:
                if r.status == 404:
                    raise ChunkUnavailable(f"{kind} {cid[:16]}... not held")
                if r.status != 200:
                    raise TransportError(f"{kind} request answered HTTP {r.status}")
                if r.content_length is not None and r.content_length > limit:
                    raise ProtocolError(f"{kind} of {r.content_length} bytes exceeds {limit}")
                data = await r.content.read(limit + 1)
                if len(data) > limit:
                    raise ProtocolError(f"{kind} exceeds {limit} bytes")
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise TransportError(f"{kind} request failed: {exc!r}") from exc

    async def get_manifest(self, provider: object, cid: str) -> bytes:
        return await self._small(provider, "manifest", cid, MAX_MANIFEST_ENVELOPE_SIZE)

    async def get_have(self, provider: object, manifest_cid: str) -> bytes:
        return await self._small(provider, "have", manifest_cid, MAX_HAVE_SIZE)

    async def read_chunk(self, provider: object, cid: str, length: int,
                         sink: Callable[[bytes], None]) -> None:
        """Stream chunk ``cid`` into ``sink``; IntegrityError if the peer announces or sends too much."""
        assert length <= MAX_CHUNK_SIZE
        try:
            async with self._session.get(self._url(provider, "chunk", cid), timeout=self._timeout) as r:
                if r.status == 404:
                    raise ChunkUnavailable(f"chunk {cid[:16]}... not held")
                if r.status != 200:
                    raise TransportError(f"chunk request answered HTTP {r.status}")
                if r.content_length is not None and r.content_length != length:
                    raise IntegrityError(f"chunk announced as {r.content_length} bytes, expected {length}")
                while True:
                    piece = await r.content.read(READ_PIECE)
                    if not piece:
                        break
                    sink(piece)  # the sink refuses bytes past ``length`` before writing them
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise TransportError(f"chunk transfer failed: {exc!r}") from exc
