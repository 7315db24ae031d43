"""Bulk blob bytes over HTTP (aiohttp): the server routes and the client-side chunk source.

Routes (mounted on the node's bulk HTTP app, see :func:`blob_routes`)::

    GET /blob/v1/manifest/<blob-cid>   signed manifest envelope bytes
    GET /blob/v1/chunk/<chunk-cid>     the chunk's bytes (sendfile from the chunk file, zero-copy)
    GET /blob/v1/have/<blob-cid>       msgpack ``Have`` bitmap of the chunks this node holds
        ?after=<version>&wait_ms=<ms>  ...once the store is past ``version`` (held open up to 2 s);
                                       ``X-Blob-Version`` says the version answered (docs/blobs.md)

A chunk request may carry ``X-Blob-If-Idle: 1``: "only if you are not sending this chunk to someone
else right now (or did a moment ago)". A node that is answers ``503`` with ``X-Blob-Busy: 1`` instead,
and the requester takes another chunk and comes back (or, once the other peer holds it, asks that
peer). This is what
keeps an origin from sending one chunk to several peers at once when they picked the same rare chunk
in the same moment: over shaped links such overlaps made the origin send 1.4 copies of a file
(bench/README.md, "broadcast"). Requests without the header (earlier versions) are served as before.

HTTP rather than libp2p streams because a TCP + Noise + Yamux stream measured about 13x slower than
plain TCP here (docs/libp2p.md, "Streams and muxing"). Nothing served needs trust: chunks are checked
against their CID and manifests against their CID and signature by the receiver.

:class:`HttpChunkSource` is the default :class:`~intellect_node.blobs.fetch.ChunkSource`: it reads
responses piece by piece into the receiver's sink, so no chunk is buffered whole in memory.

Shortcut: the client speaks only the subset of HTTP/1.1 the blob routes use (GET, ``Content-Length``
bodies, keep-alive); a provider behind a proxy that answers with chunked encoding is treated as
unreachable.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from intellect_node.blobs.addresses import AddressPolicy, AddressRefused
from intellect_node.blobs.pacing import SeedPacer, Turn
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import ChunkUnavailable, IntegrityError, ProtocolError, TransportError
from intellect_node.protocol.blob import (
    HTTP_PREFIX,
    MAX_CHUNK_SIZE,
    MAX_HAVE_SIZE,
    MAX_MANIFEST_ENVELOPE_SIZE,
)
from intellect_node.protocol.gossip import validate_http_url
from intellect_node.protocol.ids import validate_cid

AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str,
                 tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes]]
"""One ``getaddrinfo`` answer: family, socket type, protocol, canonical name, socket address."""
OCTET = "application/octet-stream"


IF_IDLE = "X-Blob-If-Idle"
BUSY = "X-Blob-Busy"
VERSION = "X-Blob-Version"
MAX_HAVE_WAIT_S = 2.0
"""The longest a ``/have?after=`` request is held open (the client's read deadline is longer)."""
MAX_HAVE_WAITERS = 256
"""Bitmap requests held open at once; past this they are answered at once (bounded connections)."""


class ChunkBusy(ChunkUnavailable):
    """The provider is sending this chunk to another peer right now (it answered ``X-Blob-Busy``): ask
    again shortly, or the peer it goes to."""


@dataclass
class ServeStats:
    """Counters of what this node served (status, /metrics and tests read them)."""

    chunks: int = 0
    bytes: int = 0
    busy: int = 0  # requests answered X-Blob-Busy
    have_waiters: int = 0  # bitmap requests held open now (``/have?after=``)
    requests_by_cid: dict[str, int] = field(default_factory=dict)
    sending: dict[str, int] = field(default_factory=dict)  # chunk CID -> responses being sent now
    sent_at: dict[str, float] = field(default_factory=dict)  # chunk CID -> when a send last ended
    pacer: "SeedPacer" = field(default_factory=lambda: SeedPacer())
    busy_after_send_s: float = 1.0
    """A chunk sent this recently counts as busy too: its receiver holds it now, and a peer asking
    within this time has not yet seen that peer's bitmap (refreshed every 0.2 s)."""

    def busy_with(self, cid: str) -> bool:
        if self.sending.get(cid):
            return True
        return time.monotonic() - self.sent_at.get(cid, float("-inf")) < self.busy_after_send_s

    def sent(self, cid: str) -> None:
        now = time.monotonic()
        if len(self.sent_at) > 4096:  # keep only what can still answer busy
            self.sent_at = {c: t for c, t in self.sent_at.items() if now - t < self.busy_after_send_s}
        self.sent_at[cid] = now


class _ChunkResponse(web.StreamResponse):
    """A chunk file's bytes with ``sendfile``, counted in ``stats.sending`` while they go out, holding a
    seed's turn (``turn``) while they do.

    Leaner than aiohttp's ``FileResponse`` on purpose: a chunk file is immutable and local, so there is no
    conditional request, range, pre-compressed variant or executor round trip to open and close it
    (about two thirds of the server's CPU per request, bench/README.md "broadcast"). The file is opened
    on the loop: it is on the node's own disk, and usually just written or just sent (page cache). A
    chunk removed since the handler looked (``blob rm``, gc) is answered 404 as before."""

    def __init__(self, stats: ServeStats, cid: str, path: Path, size: int, turn: "Turn | None") -> None:
        super().__init__(headers={"Content-Type": OCTET, "Cache-Control": "immutable"})
        self.content_length = size
        self._stats, self._cid, self._path, self._size, self._turn = stats, cid, path, size, turn

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self.prepared:
            return await super().prepare(request)
        sending = self._stats.sending
        sending[self._cid] = sending.get(self._cid, 0) + 1
        ok = False
        if self._turn is not None:
            self._turn.start(self._size)
        try:
            if request.method == "HEAD":
                return await super().prepare(request)  # the headers alone
            try:
                fobj = open(self._path, "rb")  # noqa: SIM115 (closed below)
            except OSError:
                self.set_status(404)
                self.content_length = 0
                return await super().prepare(request)
            try:
                writer = await super().prepare(request)  # the status line and headers, written at once
                transport = request.transport
                if transport is None:
                    raise ConnectionResetError("connection lost")
                await asyncio.get_running_loop().sendfile(transport, fobj, 0, self._size)
                await super().write_eof()
            finally:
                fobj.close()
            ok = True
            return writer
        finally:
            if self._turn is not None:
                self._turn.end(self._size, ok)
            if (left := sending[self._cid] - 1) > 0:
                sending[self._cid] = left
            else:
                del sending[self._cid]
            self._stats.sent(self._cid)


def _have_wait(request: web.Request) -> tuple[int, float]:
    """``?after=<version>&wait_ms=<ms>`` of a bitmap request: hold the answer until this node's store
    is past ``version`` or ``wait_ms`` passed (capped at MAX_HAVE_WAIT_S). (-1, 0) without them."""
    after, wait_ms = request.query.get("after"), request.query.get("wait_ms", "1000")
    if after is None:
        return -1, 0.0
    if not (after.isdigit() and len(after) <= 18 and wait_ms.isdigit() and len(wait_ms) <= 6):
        raise web.HTTPBadRequest(text="'after' and 'wait_ms' must be non-negative integers")
    return int(after), min(MAX_HAVE_WAIT_S, int(wait_ms) / 1000)


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

    changed = [asyncio.Event()]

    def wake() -> None:
        changed[0].set()
        changed[0] = asyncio.Event()

    store.on_chunk(wake)

    async def get_have(request: web.Request) -> web.StreamResponse:
        cid = _cid(request)
        after, wait_s = _have_wait(request)
        if after == store.version and store.manifest(cid) is not None \
                and stats.have_waiters < MAX_HAVE_WAITERS:
            stats.have_waiters += 1
            try:
                async with asyncio.timeout(wait_s):
                    while store.version == after:
                        await changed[0].wait()
            except TimeoutError:
                pass  # nothing new: the asker gets the same bitmap and asks again
            finally:
                stats.have_waiters -= 1
        version = store.version  # before the bitmap: a chunk landing in between shows next time
        raw = store.have_bytes(cid)
        if raw is None:
            raise web.HTTPNotFound(text="unknown manifest")
        return web.Response(body=raw, content_type=OCTET, headers={VERSION: str(version)})

    async def get_chunk(request: web.Request) -> web.StreamResponse:
        cid = _cid(request)
        if not store.has_chunk(cid):
            raise web.HTTPNotFound(text="chunk not held")
        turn: Turn | None = None
        if request.headers.get(IF_IDLE) == "1":  # asked as a seed: one chunk at a time, each once
            if not stats.busy_with(cid):
                turn = await stats.pacer.turn(request.remote or "")
                if turn is not None and (stats.busy_with(cid) or not store.has_chunk(cid)):
                    turn.release()  # sent to someone else (or removed) while this one waited
                    turn = None
            if turn is None:
                stats.busy += 1
                raise web.HTTPServiceUnavailable(text="sending this chunk to another peer",
                                                 headers={BUSY: "1"})
        try:
            path = store.chunk_path(cid)
            size = path.stat().st_size
        except OSError as exc:
            if turn is not None:
                turn.release()
            raise web.HTTPNotFound(text="chunk not held") from exc
        stats.chunks += 1
        stats.bytes += size
        stats.requests_by_cid[cid] = stats.requests_by_cid.get(cid, 0) + 1
        return _ChunkResponse(stats, cid, path, size, turn)  # chunk files are immutable once renamed in

    return [
        web.get(f"{HTTP_PREFIX}/manifest/{{cid}}", get_manifest),
        web.get(f"{HTTP_PREFIX}/have/{{cid}}", get_have),
        web.get(f"{HTTP_PREFIX}/chunk/{{cid}}", get_chunk),
    ]


READ_BUFFER = 1 << 20
"""Receive buffer per connection: one ``recv_into`` moves up to this much from the socket."""

MAX_HEADER_BYTES = 16 * 1024
MAX_IDLE_PER_HOST = 16


class ChunkSink(Protocol):
    """Where a source puts a chunk's bytes (a :class:`~intellect_node.blobs.store.ChunkWriter`, which
    hashes each piece and refuses bytes past the chunk's length)."""

    def write(self, piece: bytes | bytearray | memoryview) -> None: ...


class _Discard:
    def write(self, piece: bytes | bytearray | memoryview) -> None:
        pass


class _Collect:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        self.data += piece


_SPARE_BUFFERS: list[bytearray] = []
"""Receive buffers of closed connections, for the next ones (a fresh 1 MiB buffer costs its page
faults again; at most MAX_SPARE_BUFFERS are kept)."""
MAX_SPARE_BUFFERS = 16


class _Conn:
    """One keep-alive HTTP/1.1 connection and its receive buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = _SPARE_BUFFERS.pop() if _SPARE_BUFFERS else bytearray(READ_BUFFER)
        self.view = memoryview(self.buf)
        self.pending = b""  # bytes read past the end of the previous header block

    def close(self) -> None:
        self.sock.close()
        buf, self.buf, self.view = self.buf, bytearray(), memoryview(b"")  # no use after close
        if buf and len(_SPARE_BUFFERS) < MAX_SPARE_BUFFERS:  # once: a second close finds it empty
            _SPARE_BUFFERS.append(buf)


class HttpChunkSource:
    """Fetch manifests, bitmaps and chunks from a provider's advertised ``http_url``.

    A deliberately small HTTP/1.1 client (GET, ``Content-Length`` bodies, keep-alive) over non-blocking
    sockets: the body is received with ``recv_into`` into one reusable buffer per connection and handed
    to the sink as memoryviews, so each byte is copied once from the kernel, hashed, and written once.
    aiohttp's client measured at a fraction of that on this machine (it allocates a bytes object per
    socket read and joins them again). The server side stays aiohttp with ``sendfile``.
    """

    def __init__(self, *, connect_timeout: float = 5.0, read_timeout: float = 15.0,
                 addresses: AddressPolicy | None = None) -> None:
        # Split by phase: a dead peer fails the connect fast; a frozen one (SIGSTOP) fails a read.
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.addresses = addresses
        """Where a provider's URL may lead (``blobs/addresses.py``); None: anywhere (providers given by
        hand: tests, benchmarks, the bare blob peer)."""
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._addr_cache: dict[tuple[str, int], AddrInfo] = {}
        self._split_cache: dict[str, tuple[str, int, str]] = {}  # provider URL -> (host, port, path)

    speaks_if_idle = True  # read_chunk takes if_idle (see IdleAwareSource)

    def accepts(self, provider: object) -> bool:
        return str(getattr(provider, "http_url", "") or "").startswith("http://")

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    # -- connections ----------------------------------------------------------------------------

    def _split(self, provider: object) -> tuple[str, int, str]:
        raw = str(getattr(provider, "http_url"))
        if (hit := self._split_cache.get(raw)) is not None:
            return hit
        if len(self._split_cache) >= 1024:
            self._split_cache.clear()
        self._split_cache[raw] = out = self._parse(raw)
        return out

    @staticmethod
    def _parse(raw: str) -> tuple[str, int, str]:
        """(host, port, path prefix) of a provider URL; TransportError for one this client cannot use
        (every check of ``validate_http_url``, so no URL fails later in another way)."""
        try:
            validate_http_url(raw)
        except ProtocolError as exc:
            raise TransportError(f"unusable provider URL: {exc}") from exc
        url = urlsplit(raw)
        if url.scheme != "http" or not url.hostname:
            raise TransportError(f"unsupported provider URL {raw[:80]!r} (plain http:// only)")
        return url.hostname, url.port or 80, url.path.rstrip("/")

    async def _resolve(self, provider: object, host: str, port: int) -> AddrInfo:
        """The address ``host`` names, checked against the address policy for ``provider``."""
        key = (host, port)
        addr = self._addr_cache.get(key)
        if addr is None:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError, UnicodeError) as exc:
                raise TransportError(f"cannot resolve {host}:{port}: {exc!r}") from exc
            if not infos:
                raise TransportError(f"cannot resolve {host}:{port}")
            if len(self._addr_cache) >= 1024:
                self._addr_cache.clear()
            addr = self._addr_cache[key] = infos[0]
        if self.addresses is not None:
            peer, ip = str(getattr(provider, "peer_id", "")), str(addr[4][0])
            why = self.addresses.refusal(peer, ip)
            if why and self.addresses.needs_proof(peer, ip) and await self.addresses.prove(peer, ip):
                why = self.addresses.refusal(peer, ip)
            if why:
                raise AddressRefused(f"provider {str(getattr(provider, 'peer_id', ''))[:16]}...: {why}")
        return addr

    async def _connect(self, addr: AddrInfo, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                family, type_, proto, _, sockaddr = addr
                sock = socket.socket(family, type_, proto)
                sock.setblocking(False)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await loop.sock_connect(sock, sockaddr)
                except BaseException:
                    sock.close()
                    raise
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"cannot connect to {host}:{port}: {exc!r}") from exc
        return _Conn(sock)

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < MAX_IDLE_PER_HOST:
            idle.append(conn)
        else:
            conn.close()

    async def _recv(self, conn: _Conn, view: memoryview) -> int:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.read_timeout):
            return await loop.sock_recv_into(conn.sock, view)

    async def _head(self, conn: _Conn, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """Send ``request``; read the status line and headers. Returns (status, headers, body prefix)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.read_timeout):
            await loop.sock_sendall(conn.sock, request)
        data = bytearray(conn.pending)
        conn.pending = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            if len(data) > MAX_HEADER_BYTES:
                raise ProtocolError("HTTP header block too large")
            n = await self._recv(conn, conn.view[:65536])
            if n == 0:
                raise ConnectionResetError("connection closed before the response")
            data += conn.view[:n]
        lines = bytes(data[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad HTTP status line {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError("bad HTTP header line")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers, bytes(data[end + 4:])

    async def _get(self, provider: object, path: str, *, sink: "ChunkSink",
                   check_length: Callable[[int], None], extra: str = "") -> tuple[int, dict[str, str]]:
        """GET ``path`` (``extra``: more header lines, each ending CRLF); stream the body to ``sink``;
        return the status and headers. Retries once on a stale keep-alive connection (the server may
        have closed it while idle)."""
        host, port, base = self._split(provider)
        addr = await self._resolve(provider, host, port)
        key = (host, port)
        request = (f"GET {base}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                   f"Accept-Encoding: identity\r\n{extra}\r\n").encode("ascii")
        for attempt in (0, 1):
            idle = self._idle.get(key)
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(addr, host, port)
            try:
                try:
                    status, headers, prefix = await self._head(conn, request)
                except (ConnectionError, BrokenPipeError):
                    if reused and attempt == 0:
                        conn.close()
                        continue
                    raise
                await self._body(key, conn, status, headers, prefix, sink, check_length)
                return status, headers
            except BaseException as exc:
                conn.close()
                if isinstance(exc, (OSError, TimeoutError)):
                    raise TransportError(f"GET {path[:40]}... from {host}:{port} failed: {exc!r}") from exc
                raise
        raise AssertionError("unreachable")

    async def _body(self, key: tuple[str, int], conn: _Conn, status: int, headers: dict[str, str],
                    prefix: bytes, sink: "ChunkSink", check_length: Callable[[int], None]) -> None:
        if "transfer-encoding" in headers:
            raise TransportError("chunked transfer encoding is not used by the blob protocol")
        try:
            length = int(headers["content-length"])
        except (KeyError, ValueError) as exc:
            raise ProtocolError("response without a valid Content-Length") from exc
        if length < 0:
            raise ProtocolError("negative Content-Length")
        if status == 200:
            check_length(length)  # raises before a byte of an oversize body is read
        elif length > 65536:
            raise TransportError(f"HTTP {status} with a {length}-byte body")
        else:
            sink = _Discard()  # an error body: read and drop it to keep the connection usable
        left = length
        if prefix:
            head = memoryview(prefix)[:left]
            conn.pending = prefix[len(head):]
            sink.write(head)
            left -= len(head)
        # One deadline for the body, pushed back as bytes come (at most once a second): a provider
        # silent for read_timeout fails (up to a second sooner), as with a deadline per read, without
        # the cost of one per read.
        loop = asyncio.get_running_loop()
        sock, view = conn.sock, conn.view
        extend_s = min(1.0, self.read_timeout / 4)
        async with asyncio.timeout(self.read_timeout) as deadline:
            extended = loop.time()
            while left:
                n = await loop.sock_recv_into(sock, view[:min(left, READ_BUFFER)])
                if n == 0:
                    raise ConnectionResetError(f"connection closed with {left} of {length} bytes missing")
                sink.write(view[:n])
                left -= n
                if (now := loop.time()) - extended > extend_s:
                    deadline.reschedule(now + self.read_timeout)
                    extended = now
        if headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._release(key, conn)

    # -- the ChunkSource interface --------------------------------------------------------------

    async def _small(self, provider: object, kind: str, cid: str, limit: int, query: str = ""
                     ) -> tuple[bytes, dict[str, str]]:
        out = _Collect()

        def check(n: int) -> None:
            if n > limit:
                raise ProtocolError(f"{kind} of {n} bytes exceeds {limit}")

        status, headers = await self._get(provider, f"{HTTP_PREFIX}/{kind}/{cid}{query}", sink=out,
                                          check_length=check)
        if status == 404:
            raise ChunkUnavailable(f"{kind} {cid[:16]}... not held")
        if status != 200:
            raise TransportError(f"{kind} request answered HTTP {status}")
        return bytes(out.data), headers

    async def get_manifest(self, provider: object, cid: str) -> bytes:
        return (await self._small(provider, "manifest", cid, MAX_MANIFEST_ENVELOPE_SIZE))[0]

    async def get_have(self, provider: object, manifest_cid: str) -> bytes:
        return (await self._small(provider, "have", manifest_cid, MAX_HAVE_SIZE))[0]

    async def get_have_after(self, provider: object, manifest_cid: str, after: int | None,
                             wait_s: float) -> tuple[bytes, int | None]:
        """The provider's bitmap once its store has changed since version ``after`` (or ``wait_s``
        passed; at once for None), and its version now: None from a provider that does not hold
        requests open (an earlier version), which the caller then polls."""
        query = "" if after is None else f"?after={after}&wait_ms={int(wait_s * 1000)}"
        raw, headers = await self._small(provider, "have", manifest_cid, MAX_HAVE_SIZE, query)
        version = headers.get(VERSION.lower(), "")
        return raw, int(version) if version.isdigit() and len(version) <= 18 else None

    async def read_chunk(self, provider: object, cid: str, length: int, sink: "ChunkSink", *,
                         if_idle: bool = True) -> None:
        """Stream chunk ``cid`` into ``sink``; IntegrityError if the peer announces another length (the
        sink itself refuses bytes past ``length``). ``if_idle``: send ``X-Blob-If-Idle`` (ChunkBusy if
        the provider is sending this chunk to someone else or just did)."""
        assert length <= MAX_CHUNK_SIZE

        def check(n: int) -> None:
            if n != length:
                raise IntegrityError(f"chunk announced as {n} bytes, expected {length}")

        status, headers = await self._get(provider, f"{HTTP_PREFIX}/chunk/{cid}", sink=sink,
                                          check_length=check,
                                          extra=f"{IF_IDLE}: 1\r\n" if if_idle else "")
        if status == 404:
            raise ChunkUnavailable(f"chunk {cid[:16]}... not held")
        if status == 503 and headers.get(BUSY.lower()) == "1":
            raise ChunkBusy(f"chunk {cid[:16]}... is being sent to another peer")
        if status != 200:
            raise TransportError(f"chunk request answered HTTP {status}")
