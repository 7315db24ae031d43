"""Limits on the bulk HTTP server: what a peer can hold of it with connections it opens and never uses.

aiohttp's server has no timeout for reading a request head, no connection cap and no deadline for
sending a response: a slowloris (many connections, each sending a byte of a request head now and then)
or a client that asks for a chunk and never reads it holds sockets and file descriptors for as long as
it likes, and once the process runs out of descriptors every accept fails, honest fetches included.
What we do:

1. :class:`ConnectionGate` wraps each accepted connection's protocol. A connection must deliver a
   complete request head (the blank line after the headers) within ``head_timeout_s`` of being
   accepted, or it is closed. Later requests on a kept-alive connection get the same bound from
   aiohttp's ``keepalive_timeout`` (set to ``head_timeout_s`` by :func:`runner_kwargs`): aiohttp
   closes a connection that waits that long for a complete next request, whatever part of one came
   (aiohttp's behaviour, not ours: pyproject.toml pins the tested range, and a test checks it).
2. At most ``max_connections`` open connections, and ``per_address`` from one remote address. A new
   connection over either cap closes the oldest connection (of that address, when it is the address's
   cap) that has not sent a complete request head yet; when there is none it is refused (reset).
   Honest clients send their request at once, so their new connections are the ones kept.
3. :func:`send_deadline` (a middleware) gives the handler :data:`HANDLER_TIMEOUT_S` and the response's
   bytes ``SEND_BASE_S + size / MIN_SEND_BYTES_PER_S`` to leave; past that the connection is aborted.

Shortcut: the caps count connections, not bytes; a peer with many addresses gets ``per_address`` on
each of them (the global cap still holds).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from aiohttp import web

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0
"""Seconds a connection may take to send a complete request head (and, kept alive, the next one). The
blob client sends its request in one write right after connecting, so an honest head takes one
round trip; the bound leaves room for a slow link."""
MAX_CONNECTIONS = 4096
"""Open bulk HTTP connections at most, further capped at half the process's open-file soft limit (the
rest is for libp2p, the store's files and the control API)."""
PER_ADDRESS = 256
"""Open connections from one remote address at most. A fetcher holds about 2 requests per provider per
blob and keeps up to 16 idle connections per host (``blobs/http.py``); this leaves room for many nodes
behind one NAT address, and for many test nodes on loopback."""
HANDLER_TIMEOUT_S = 30.0
"""What a route handler may take before its response starts (a held ``have`` request waits up to 2 s,
a seed's turn up to 2 s)."""
SEND_BASE_S = 10.0
MIN_SEND_BYTES_PER_S = 64 * 1024
"""A response of N bytes must be sent within ``SEND_BASE_S + N / MIN_SEND_BYTES_PER_S`` s (3 MiB
chunk: 58 s; a reader slower than 64 KiB/s should fetch from someone else)."""


@dataclass(frozen=True)
class BulkLimits:
    """The bulk server's limits (module constants by default)."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    per_address: int = PER_ADDRESS

    def effective_max_connections(self) -> int:
        """``max_connections``, at most half the open-file soft limit (at least 16)."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(16, min(self.max_connections, soft // 2))


class RunnerOptions(TypedDict, total=False):
    """What :func:`runner_kwargs` sets of ``web.AppRunner``'s keyword arguments (none: its defaults)."""

    keepalive_timeout: float


def runner_kwargs(limits: BulkLimits) -> RunnerOptions:
    """Keyword arguments for the bulk app's ``web.AppRunner``: a kept-alive connection waits at most
    ``head_timeout_s`` for its next complete request."""
    return {"keepalive_timeout": limits.head_timeout_s}


class _Conn:
    __slots__ = ("address", "transport", "timer", "head_seen", "tail")

    def __init__(self, address: str, transport: asyncio.Transport) -> None:
        self.address = address
        self.transport = transport
        self.timer: asyncio.TimerHandle | None = None
        self.head_seen = False
        self.tail = b""  # the last 3 bytes received, to find a head end split across reads


class ConnectionGate:
    """Counts and bounds the bulk server's connections (see the module docstring).

    ``gate.protocol_factory(server)`` is what ``loop.create_server`` gets in place of aiohttp's
    ``web.Server``; :meth:`stats` says what it refused and closed."""

    def __init__(self, limits: BulkLimits) -> None:
        self.limits = limits
        self.max_connections = limits.effective_max_connections()
        self._open: dict[_GatedProtocol, _Conn] = {}
        self._by_address: dict[str, int] = {}
        self._waiting: OrderedDict[_GatedProtocol, None] = OrderedDict()  # no complete head yet, oldest first
        self.refused = 0
        self.evicted = 0
        self.head_timeouts = 0

    def protocol_factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GatedProtocol(self, server)

    def stats(self) -> dict[str, int]:
        return {"open": len(self._open), "waiting_for_head": len(self._waiting),
                "max_connections": self.max_connections, "per_address": self.limits.per_address,
                "refused": self.refused, "evicted": self.evicted, "head_timeouts": self.head_timeouts}

    # -- admission ------------------------------------------------------------------------------

    def admit(self, proto: _GatedProtocol, transport: asyncio.Transport) -> bool:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if self._by_address.get(address, 0) >= self.limits.per_address and not self._evict(address):
            self.refused += 1
            return False
        if len(self._open) >= self.max_connections and not self._evict(None):
            self.refused += 1
            return False
        conn = _Conn(address, transport)
        self._open[proto] = conn
        self._by_address[address] = self._by_address.get(address, 0) + 1
        self._waiting[proto] = None
        conn.timer = asyncio.get_running_loop().call_later(self.limits.head_timeout_s, self._head_late, proto)
        return True

    def _evict(self, address: str | None) -> bool:
        """Close the oldest connection still waiting for its request head (of ``address``, if given)."""
        for proto in self._waiting:
            if address is None or self._open[proto].address == address:
                self.evicted += 1
                self._close(proto)
                return True
        return False

    def _head_late(self, proto: _GatedProtocol) -> None:
        if proto in self._waiting:
            self.head_timeouts += 1
            self._close(proto)

    def _close(self, proto: _GatedProtocol) -> None:
        conn = self.release(proto)
        if conn is not None:
            conn.transport.abort()

    def release(self, proto: _GatedProtocol) -> _Conn | None:
        """Forget ``proto``'s connection (closed, or about to be); its counts go at once."""
        conn = self._open.pop(proto, None)
        if conn is None:
            return None
        self._waiting.pop(proto, None)
        if conn.timer is not None:
            conn.timer.cancel()
        left = self._by_address[conn.address] - 1
        if left:
            self._by_address[conn.address] = left
        else:
            del self._by_address[conn.address]
        return conn

    def received(self, proto: _GatedProtocol, data: bytes) -> bool:
        """Bytes arrived on a connection still waiting for its first request head; whether it still
        waits for it."""
        conn = self._open.get(proto)
        if conn is None or conn.head_seen:
            return False
        if b"\r\n\r\n" in conn.tail + data[:4] or b"\r\n\r\n" in data:
            conn.head_seen = True
            self._waiting.pop(proto, None)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None
            return False
        conn.tail = (conn.tail + data[-3:])[-3:]
        return True


class _GatedProtocol(asyncio.Protocol):
    """Stands in front of aiohttp's protocol for one connection: admits it through the gate (creating
    aiohttp's protocol only then) and passes every event on."""

    def __init__(self, gate: ConnectionGate, make: Callable[[], asyncio.Protocol]) -> None:
        self._gate = gate
        self._make = make
        self._inner: asyncio.Protocol | None = None
        self._waiting_head = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if not self._gate.admit(self, transport):
            transport.abort()
            return
        self._inner = self._make()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self._waiting_head:
            self._waiting_head = self._gate.received(self, data)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.release(self)
        if self._inner is not None:
            self._inner.connection_lost(exc)


class GatedSite(web.SockSite):
    """``web.SockSite`` whose connections pass ``gate`` first."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, gate: ConnectionGate,
                 **kwargs: Any) -> None:
        super().__init__(runner, sock, **kwargs)
        self.gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; SockSite.start would serve ungated
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.gate.protocol_factory(server), sock=self._sock, backlog=self._backlog)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def send_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler gets :data:`HANDLER_TIMEOUT_S`, its response's bytes ``SEND_BASE_S + size /
    MIN_SEND_BYTES_PER_S``; past either the connection is aborted (a reader that stopped reading
    holds nothing). A peer that closes its connection mid-response is routine: logged at debug, not as
    aiohttp's error with a traceback."""
    try:
        async with asyncio.timeout(HANDLER_TIMEOUT_S):
            resp = await handler(request)
        if not resp.prepared:
            size = resp.content_length or 0
            async with asyncio.timeout(SEND_BASE_S + size / MIN_SEND_BYTES_PER_S):
                await resp.prepare(request)
                await resp.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        log.debug("bulk HTTP: %s %s from %s past its deadline; connection closed", request.method,
                  request.path[:80], request.remote)
        raise asyncio.CancelledError from None
    except ConnectionError:  # reset, broken pipe, aiohttp's "Connection lost": the reader went away
        if request.transport is not None:
            request.transport.abort()
        log.debug("bulk HTTP: %s %s from %s: the peer closed the connection mid-response", request.method,
                  request.path[:80], request.remote)
        raise asyncio.CancelledError from None
    return resp
