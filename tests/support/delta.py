"""Helpers for the delta tests: policies from real AdamW steps, blob peers serving on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from aiohttp import web

from intellect_node.blobs.fetch import Provider, StaticProvider
from intellect_node.blobs.http import HttpChunkSource
from intellect_node.blobs.service import BlobService
from intellect_node.blobs.store import BlobStore
from intellect_node.protocol.signing import SigningKey
from intellect_node.trainer.policy_weights import PolicyWeights


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64))


def policy_versions(dtype: torch.dtype, n: int, lr: float = 3e-5) -> list[PolicyWeights]:
    """``n`` consecutive policies from real AdamW steps (fp32 master weights, published in ``dtype``)."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        out.append(PolicyWeights.from_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()}))
        tokens = torch.randint(0, 64, (16, 8), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


class LinkLimitedSource(HttpChunkSource):
    """HTTP chunk source behind an emulated downlink of ``rate`` bytes/s (benchmarks only): each chunk
    is handed over no earlier than the link could have delivered it after the chunks before it."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate
        self._free_at = 0.0

    async def read_chunk(self, provider: object, cid: str, length: int, sink: Any) -> None:
        start = max(time.monotonic(), self._free_at)
        self._free_at = start + length / self.rate
        held = _Buffer()
        await super().read_chunk(provider, cid, length, held)
        delay = self._free_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sink.write(held.data)


class _Buffer:
    """A chunk sink that keeps the bytes (the source's pieces are views of a reused buffer)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        self.data += piece


class BlobPeer:
    """A blob service with its own store, key and HTTP server on 127.0.0.1; providers as the test says.
    ``link_rate`` (bytes/s) emulates a slower downlink for benchmarks."""

    def __init__(self, root: Path, key: SigningKey | None = None, link_rate: float | None = None) -> None:
        self.providers: list[Provider] = []
        self.rejections: list[tuple[str, str]] = []

        async def find(cid: str) -> Sequence[Provider]:
            return list(self.providers)

        extra = [LinkLimitedSource(link_rate)] if link_rate else []
        self.blobs = BlobService(BlobStore(root), key or SigningKey.generate(), find_providers=find,
                                 penalise=lambda peer, why: self.rejections.append((peer, why)),
                                 extra_sources=extra)
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def key(self) -> SigningKey:
        return self.blobs.key

    def as_provider(self) -> StaticProvider:
        return StaticProvider(self.key.peer_id, self.url)

    async def start(self) -> "BlobPeer":
        app = web.Application()
        app.add_routes(self.blobs.routes())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        await self.blobs.start(announce=False)
        return self

    async def stop(self) -> None:
        await self.blobs.close()
        if self._runner is not None:
            await self._runner.cleanup()


def mesh(peers: Sequence[BlobPeer]) -> None:
    """Every peer may fetch from every other (what the DHT would answer)."""
    for p in peers:
        p.providers = [q.as_provider() for q in peers if q is not p]
