"""``GET /feed/v1`` on the bulk HTTP port: this node's signed run feed (``protocol/feed.py``), the lines a
report made from the swarm draws (``intellect-node run report --run CID``).

A trainer's feed carries its ``trainer/metrics.jsonl``, a validator's that evaluates its
``validator/held_out.jsonl``; a node with neither answers 404. Each request reads the newest lines again
(the files are appended to while the node runs; a torn last line is left out), at most
:data:`~intellect_node.protocol.feed.MAX_FEED_LINES` of each, in a worker thread; the sealed answer is
kept for :data:`CACHE_S` seconds, so a peer asking over and over costs one read and one signature each
time it expires, not one per request."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Protocol

from aiohttp import web

from intellect_node.config import NodeConfig
from intellect_node.fsutil import read_jsonl
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol.feed import FEED_HTTP_PATH, MAX_FEED_LINES, MAX_LINE_BYTES, RunFeed, seal_feed

CACHE_S = 10.0
METRICS = Path("trainer") / "metrics.jsonl"
HELD_OUT = Path("validator") / "held_out.jsonl"


class FeedRuntime(Protocol):
    @property
    def config(self) -> NodeConfig: ...

    @property
    def swarm(self) -> Swarm: ...

    @property
    def data_dir(self) -> Path: ...


def _lines(path: Path) -> list[str]:
    """The newest lines of a JSONL file as compact JSON text, each under the feed's line bound."""
    out = [json.dumps(doc, separators=(",", ":")) for doc in read_jsonl(path)[-MAX_FEED_LINES:]]
    return [line for line in out if len(line) <= MAX_LINE_BYTES]


def feed_of(data_dir: Path, run_id: str, node: str) -> RunFeed:
    return RunFeed(node=node, time_ms=int(time.time() * 1000), run_id=run_id,
                   metrics=_lines(data_dir / METRICS), held_out=_lines(data_dir / HELD_OUT))


class FeedService:
    """Serves the feed (module docstring); nothing to start or stop."""

    name = "feed"

    def __init__(self, runtime: FeedRuntime) -> None:
        self._rt = runtime
        self._cached: tuple[float, bytes | None] = (-CACHE_S, None)  # (monotonic time, sealed feed)
        self._lock = asyncio.Lock()

    async def _sealed(self) -> bytes | None:
        """The sealed feed, read again at most every :data:`CACHE_S` (None: nothing to serve)."""
        async with self._lock:  # concurrent requests wait for one read, not one each
            at, body = self._cached
            if time.monotonic() - at < CACHE_S:
                return body
            rt = self._rt
            feed = await asyncio.to_thread(feed_of, rt.data_dir, rt.config.run.run_id, rt.swarm.peer_id)
            body = None if not feed.metrics and not feed.held_out else \
                await asyncio.to_thread(seal_feed, rt.swarm.key, feed)
            self._cached = (time.monotonic(), body)
            return body

    @classmethod
    def for_runtime(cls, rt: FeedRuntime) -> "FeedService":
        return cls(rt)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def routes(self) -> list[web.RouteDef]:
        async def get(_request: web.Request) -> web.StreamResponse:
            body = await self._sealed()
            if body is None:
                return web.Response(status=404, text="no metrics or held-out results here")
            return web.Response(body=body, content_type="application/octet-stream")

        return [web.get(FEED_HTTP_PATH, get)]
