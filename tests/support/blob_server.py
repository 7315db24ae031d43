"""A blob store served over real HTTP on 127.0.0.1 (the node's own routes), for tests of fetchers."""

from __future__ import annotations

from aiohttp import web

from intellect_node.blobs.http import blob_routes
from intellect_node.blobs.store import BlobStore


async def serve_store(store: BlobStore) -> tuple[web.AppRunner, str]:
    """Serve ``store`` on a free port; returns the runner (``await runner.cleanup()`` to stop) and its
    base URL."""
    app = web.Application()
    app.add_routes(blob_routes(store))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]  # a started site has its server
