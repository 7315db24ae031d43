"""A peer that closes its connection mid-response is routine (``blobs/server.py``'s ``send_deadline``):
no ERROR record, no traceback. A real aiohttp server on 127.0.0.1 and a raw client that resets."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from intellect_node.blobs.server import send_deadline

BODY = b"x" * (16 << 20)  # far past any socket buffer: the send is still under way when the client resets


def test_client_reset_mid_response_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        done = asyncio.Event()

        @web.middleware
        async def finished(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                return await handler(request)
            finally:
                done.set()

        async def big(request: web.Request) -> web.Response:
            return web.Response(body=BODY)

        app = web.Application(middlewares=[finished, send_deadline])
        app.router.add_get("/big", big)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            server = site._server
            assert isinstance(server, asyncio.Server)
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await reader.readexactly(1)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # closes with SO_LINGER 0: an RST, the response half sent
            await done.wait()
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage()) for r in errors]
    assert any("closed the connection mid-response" in r.getMessage() for r in caplog.records)
