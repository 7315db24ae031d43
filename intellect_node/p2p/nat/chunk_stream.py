"""Blob chunks over a libp2p stream, for peers HTTP cannot reach (private nodes behind NAT).

Bulk bytes normally move over HTTP (docs/architecture.md). A private node has no reachable HTTP port,
so its chunks travel over the libp2p connection we do have to it: punched (direct) or relayed. The same
content addressing holds: every chunk is checked against its CID on arrival (IntegrityError otherwise).

Wire (``/intellect/blob-chunk/1.0.0``), one request per stream:

    request   u32 length + codec(ChunkRequest{kind, cid})        at most MAX_REQUEST bytes
    response  u32 length + codec(ChunkResponse{status, size, budget_left}) then ``size`` raw bytes

A relay grants each circuit a byte budget (circuit v2 ``Limit.data``; the relay resets the circuit
beyond it). The serving side counts what chunk streams move over each relayed connection and refuses
(status ``relay-budget``) a chunk that would take the connection past BUDGET_SHARE of the relay's limit:
the rest of the budget is left to gossip, DHT and protocol overhead (Noise + Yamux add under 1 %). It
knows the limit from its own reservation with that relay; on a relayed connection whose limit it does
not know it assumes go-libp2p's default relay limit (128 KiB). Shortcut: the budget is tracked per
connection in memory, not shared with other protocols' actual byte counts.

What a peer can make this node hold: a served item is read into memory whole and written while the
reader reads, so a reader that stops reading pins it until the stream's deadline (READ_TIMEOUT_S). A
peer has at most MAX_STREAMS_PER_PEER chunk streams being served at once (every connection it has
together: the bound per connection is the same or tighter), and all peers together at most
MAX_SERVING_BYTES of items in flight; a request past either is answered ``busy`` at once (no item is
read for it), which the client treats as a transport failure (another source, or later).
"""

from __future__ import annotations

import logging
import struct
import weakref
from typing import Awaitable, Callable

import trio
from libp2p.abc import IHost, IMuxedConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from intellect_node.errors import IntegrityError, ProtocolError, TransportError
from intellect_node.p2p.nat.relay import relay_of_connection
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of, hash_code, validate_cid

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/intellect/blob-chunk/1.0.0"
MAX_REQUEST = 256
MAX_RESPONSE_HEADER = 256
MAX_CHUNK_BYTES = 16 * 1024 * 1024
"""Upper bound on one served item (chunks are 3 MiB by default; manifests are far smaller)."""
BUDGET_SHARE = 0.75
UNKNOWN_RELAY_LIMIT = 128 * 1024
"""go-libp2p's default per-circuit data limit: the safe assumption when the limit is not known."""
READ_TIMEOUT_S = 60.0
MAX_STREAMS_PER_PEER = 4
MAX_SERVING_BYTES = 64 * 1024 * 1024
"""Bytes of items all chunk streams together hold while their readers read them."""
KINDS = ("chunk", "manifest", "have")
MAX_HAVE_BYTES = 1 << 20
"""A have bitmap: one bit per chunk; 1 MiB covers 8 M chunks (24 TiB at 3 MiB each)."""


class ChunkRequest(codec.Message, frozen=True):
    kind: str
    cid: str


class ChunkResponse(codec.Message, frozen=True):
    status: str  # "ok" | "missing" | "relay-budget" | "busy" | "bad-request"
    size: int = 0
    budget_left: int | None = None


class RelayBudgetExceeded(TransportError):
    """The relayed connection has no byte budget left for this item; punch through or use another path."""


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.read(min(n - len(buf), 1 << 16))
        if not data:
            raise TransportError(f"stream ended after {len(buf)} of {n} bytes")
        buf.extend(data)
    return bytes(buf)


async def _read_frame(stream: INetStream, max_size: int) -> bytes:
    (n,) = struct.unpack(">I", await _read_exactly(stream, 4))
    if n > max_size:  # checked before allocating anything
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_size}")
    return await _read_exactly(stream, n)


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


Lookup = Callable[[str, str], Awaitable[bytes | None]]
"""``lookup(kind, cid)``: the stored bytes, or None when this node does not hold them."""


class ChunkStreamServer:
    """Serves ``lookup``'s chunks and manifests; register it on the host with :meth:`register`."""

    def __init__(self, host: IHost, lookup: Lookup, *,
                 relay_limits: Callable[[str], int | None] = lambda relay: None,
                 on_reject: Callable[[str, str], object] | None = None) -> None:
        self.host = host
        self.lookup = lookup
        self.relay_limits = relay_limits
        self.on_reject = on_reject
        # Bytes moved by chunk streams per relayed muxed connection (gone with the connection).
        self._used: weakref.WeakKeyDictionary[IMuxedConn, int] = weakref.WeakKeyDictionary()
        self.served_bytes = 0
        self.refused_budget = 0
        self.refused_busy = 0
        self._active: dict[str, int] = {}
        """Chunk streams being served per peer."""
        self.serving_bytes = 0

    def register(self) -> None:
        self.host.set_stream_handler(TProtocol(PROTOCOL_ID), self.handle)

    def budget_left(self, muxed_conn: IMuxedConn) -> int | None:
        relay = relay_of_connection(muxed_conn)
        if relay is None:
            return None
        limit = self.relay_limits(relay) or UNKNOWN_RELAY_LIMIT
        return max(0, int(limit * BUDGET_SHARE) - self._used.get(muxed_conn, 0))

    async def handle(self, stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        self._active[peer] = self._active.get(peer, 0) + 1
        held = 0
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                raw = await _read_frame(stream, MAX_REQUEST)
                req = codec.decode(raw, ChunkRequest, max_size=MAX_REQUEST)
                if req.kind not in KINDS:
                    raise ProtocolError(f"unknown kind {req.kind[:32]!r}")
                validate_cid(req.cid)
                conn = stream.muxed_conn
                left = self.budget_left(conn)
                data: bytes | None = b""
                if self._active[peer] > MAX_STREAMS_PER_PEER or self.serving_bytes >= MAX_SERVING_BYTES:
                    busy = True
                else:
                    data = await self.lookup(req.kind, req.cid)
                    busy = data is not None and self.serving_bytes + len(data) > MAX_SERVING_BYTES
                if busy:
                    self.refused_busy += 1
                    header = ChunkResponse(status="busy", budget_left=left)
                    data = b""
                elif data is None:
                    header = ChunkResponse(status="missing", budget_left=left)
                    data = b""
                elif left is not None and len(data) + 4 + MAX_RESPONSE_HEADER > left:
                    self.refused_budget += 1
                    header = ChunkResponse(status="relay-budget", budget_left=left)
                    data = b""
                else:
                    header = ChunkResponse(status="ok", size=len(data),
                                           budget_left=None if left is None else left - len(data))
                if left is not None:
                    cost = len(raw) + 8 + len(data) + MAX_RESPONSE_HEADER
                    self._used[conn] = self._used.get(conn, 0) + cost
                held = len(data)
                self.serving_bytes += held
                await stream.write(_frame(codec.encode(header)) + data)
                self.served_bytes += len(data)
            await stream.close()
        except ProtocolError as exc:
            if self.on_reject is not None:
                self.on_reject(peer, f"chunk-stream: {exc}")
            await stream.reset()
        except Exception as exc:  # edge of a per-peer handler: reset so the reader never hangs
            logger.debug("chunk stream from %s failed: %s", peer, exc)
            await stream.reset()
        finally:
            self.serving_bytes -= held
            self._active[peer] -= 1
            if not self._active[peer]:
                del self._active[peer]


class ChunkStreamClient:
    """Fetches items from one peer over the open libp2p connection (direct or relayed)."""

    def __init__(self, host: IHost, peer: ID, *, timeout: float = READ_TIMEOUT_S) -> None:
        self.host = host
        self.peer = peer
        self.timeout = timeout

    async def get(self, kind: str, cid: str, *, max_size: int = MAX_CHUNK_BYTES) -> bytes | None:
        """The item's bytes (checked against ``cid``), None when the peer does not hold it."""
        stream = None
        try:
            with trio.fail_after(self.timeout):
                stream = await self.host.new_stream(self.peer, [TProtocol(PROTOCOL_ID)])
                await stream.write(_frame(codec.encode(ChunkRequest(kind=kind, cid=cid))))
                header = codec.decode(await _read_frame(stream, MAX_RESPONSE_HEADER), ChunkResponse,
                                      max_size=MAX_RESPONSE_HEADER)
                if header.status == "missing":
                    return None
                if header.status == "busy":
                    raise TransportError(f"{self.peer}: busy serving other chunk streams")
                if header.status == "relay-budget":
                    raise RelayBudgetExceeded(
                        f"{self.peer}: relayed connection has {header.budget_left} bytes of budget left")
                if header.status != "ok":
                    raise ProtocolError(f"{self.peer} answered {header.status[:32]!r}")
                if not 0 <= header.size <= max_size:
                    raise ProtocolError(f"{self.peer} announced {header.size} bytes, limit {max_size}")
                data = await _read_exactly(stream, header.size)
        except trio.TooSlowError as exc:
            raise TransportError(f"{self.peer}: no answer within {self.timeout}s") from exc
        except (ProtocolError, TransportError):
            raise
        except Exception as exc:  # libp2p stream errors become ours at the boundary
            raise TransportError(f"{self.peer}: {exc}") from exc
        finally:
            if stream is not None:
                try:
                    await stream.close()
                except Exception:
                    pass
        # Chunks and manifests alike are named by the CID of their bytes (the manifest's ID is the CID
        # of its signed envelope), so both are checked here; a have bitmap is checked by its reader.
        if kind != "have" and cid_of(data, hash_code(cid)) != cid:  # the function the CID names
            raise IntegrityError(f"{kind} from {self.peer} does not match {cid}")
        return data

    async def get_chunk(self, cid: str) -> bytes:
        data = await self.get("chunk", cid)
        if data is None:
            raise TransportError(f"{self.peer} does not hold chunk {cid}")
        return data
