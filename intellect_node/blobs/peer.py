"""A bare blob peer: a store served over HTTP with the providers it is told, in-process or as a process.

In-process, :class:`BlobPeer` (a blob service, its own key and an HTTP server on 127.0.0.1; no DHT,
no libp2p): the delta tests and ``bench/delta.py`` run a trainer and followers this way::

    peers = [await BlobPeer(root / f"p{i}").start() for i in range(4)]
    mesh(peers)      # every peer may fetch from every other (what the DHT would answer)

As a process, driven by JSON lines on stdin:

``python -m intellect_node.blobs.peer --root DIR [--port 0]`` prints one JSON line
``{"event": "listening", "url": ..., "peer_id": ...}`` and then answers commands, one JSON object per
line on stdin, with JSON lines on stdout:

    {"op": "put", "path": "/abs/file", "chunk_size": 3145728}   -> {"event": "put", "cid": ...}
    {"op": "fetch", "cid": ..., "providers": [{"peer_id": ..., "http_url": ...}], "out": null}
        -> {"event": "chunk", ...}* then {"event": "done", ...} or {"event": "error", ...}
    {"op": "export", "cid": ..., "out": "/abs/file"}           -> {"event": "exported", ...}
    {"op": "stats"}                                              -> {"event": "stats", ...}

It exits when stdin closes. Providers are given, not looked up: this is the blob layer without the DHT,
used by the benchmark (many processes on 2 cores) and by tests that kill a peer or a download with
SIGKILL. A full node does the same through ``BlobService`` wired to its swarm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from aiohttp import web

from intellect_node.blobs.fetch import ChunkSource, Progress, Provider, StaticProvider
from intellect_node.blobs.service import BlobService
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import IntellectNodeError
from intellect_node.protocol.blob import DEFAULT_CHUNK_SIZE
from intellect_node.protocol.signing import SigningKey


class BlobPeer:
    """A blob service with its own store, key and HTTP server; it fetches from ``providers`` (set them,
    or :func:`mesh` a group) and records the reasons it would hold against a peer in ``rejections``.
    ``extra_sources``: chunk sources tried before plain HTTP (a benchmark's emulated slow link)."""

    def __init__(self, root: Path, key: SigningKey | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 extra_sources: Sequence[ChunkSource] = ()) -> None:
        self.providers: list[Provider] = []
        self.rejections: list[tuple[str, str]] = []
        self.host, self.port = host, port

        async def find(cid: str) -> Sequence[Provider]:
            return list(self.providers)

        self.blobs = BlobService(BlobStore(root), key or SigningKey.generate(), find_providers=find,
                                 penalise=lambda peer, why: self.rejections.append((peer, why)),
                                 extra_sources=list(extra_sources))
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def key(self) -> SigningKey:
        return self.blobs.key

    def as_provider(self) -> StaticProvider:
        return StaticProvider(self.key.peer_id, self.url)

    async def start(self, *, announce: bool = False) -> "BlobPeer":
        """Serve the bulk routes (``url`` is known from here on), then start the service."""
        app = web.Application()
        app.add_routes(self.blobs.routes())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # aiohttp's private server, set once the site started: the bound port when port=0.
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{port}"
        await self.blobs.start(announce=announce)
        return self

    async def stop(self) -> None:
        await self.blobs.close()
        if self._runner is not None:
            await self._runner.cleanup()


def mesh(peers: Sequence[BlobPeer]) -> None:
    """Every peer may fetch from every other (what the DHT would answer)."""
    for p in peers:
        p.providers = [q.as_provider() for q in peers if q is not p]


def _emit(obj: Mapping[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:  # a thread: portable, and stdin may be a pipe or a file
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    key = SigningKey(bytes.fromhex(args.seed)) if args.seed else SigningKey.generate()
    peer = await BlobPeer(args.root, key, host=args.host, port=args.port).start(announce=True)
    svc, providers, rejections = peer.blobs, peer.providers, peer.rejections
    _emit({"event": "listening", "url": peer.url, "peer_id": key.peer_id})
    threading.Thread(target=read_stdin, daemon=True).start()
    try:
        while (line := await lines.get()) is not None:
            if not line.strip():
                continue
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "put":
                chunk_size = int(cmd.get("chunk_size") or DEFAULT_CHUNK_SIZE)
                cid, m = await svc.put_file(cmd["path"], chunk_size=chunk_size)
                _emit({"event": "put", "cid": cid, "chunks": m.chunks, "size": m.total_size})
            elif op == "fetch":
                providers[:] = [StaticProvider(p["peer_id"], p["http_url"]) for p in cmd.get("providers", [])]

                def progress(p: Progress) -> None:
                    _emit({"event": "chunk", "index": p.index, "provider": p.provider,
                           "chunks_done": p.chunks_done, "chunks_total": p.chunks_total,
                           "seconds": p.seconds,
                           "t": time.monotonic()})  # system-wide clock: a benchmark lines peers up

                try:
                    st = await svc.fetch(cmd["cid"], out=cmd.get("out"), on_progress=progress)
                except IntellectNodeError as exc:
                    _emit({"event": "error", "message": str(exc)})
                    continue
                _emit({"event": "done", "chunks_fetched": st.chunks_fetched,
                       "chunks_resumed": st.chunks_resumed, "seconds": st.seconds,
                       "by_provider": st.by_provider, "failures": st.failures, "bad": st.bad,
                       "endgame_requests": st.endgame_requests, "busy_answers": st.busy_answers})
            elif op == "export":
                await asyncio.to_thread(svc.store.export, cmd["cid"], cmd["out"])
                _emit({"event": "exported", "out": cmd["out"]})
            elif op == "stats":
                times: dict[int, int] = {}  # sent n times -> how many chunks
                for n in svc.serve_stats.requests_by_cid.values():
                    times[n] = times.get(n, 0) + 1
                _emit({"event": "stats", "chunks_served": svc.serve_stats.chunks,
                       "bytes_served": svc.serve_stats.bytes, "rejections": rejections,
                       "chunks_sent_n_times": times})
            else:
                _emit({"event": "error", "message": f"unknown op {op!r}"})
    finally:
        await peer.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="blob store directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seed", default="", help="hex ed25519 seed (default: a fresh key)")
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
