"""Which chunk a fetch asks a provider for (the pure part of ``blobs/fetch.py``'s ``_Download``): rarest
first, and the seed spared for chunks a partial holder with a free slot can give. Real stores, bitmaps
decoded from the wire format; no network (the scheduler decides before any request is made)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from intellect_node.blobs.fetch import (
    PER_PROVIDER,
    SEED_REQUESTS,
    SPARE_FRESH_S,
    Fetcher,
    FetchStats,
    StaticProvider,
    _Download,
    _Peer,
)
from intellect_node.blobs.http import ChunkSink, HttpChunkSource
from intellect_node.blobs.store import BlobStore
from intellect_node.protocol.blob import decode_have, encode_have
from intellect_node.protocol.signing import SigningKey

N = 8


def _setup(tmp_path: Path) -> tuple[_Download, list[_Peer]]:
    origin = BlobStore(tmp_path / "origin")
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(N * 1024))
    cid, _ = origin.add_file(src, SigningKey.generate(), chunk_size=1024)
    mine = BlobStore(tmp_path / "mine")
    mine.put_manifest(cid, origin.manifest_bytes(cid) or b"")

    async def nobody(_: str) -> list[StaticProvider]:
        return []

    fetcher = Fetcher(mine, [HttpChunkSource()], nobody)
    peers = [_Peer(StaticProvider(f"p{k}", "http://127.0.0.1:1"), HttpChunkSource()) for k in range(3)]
    m = mine.manifest(cid)
    assert m is not None
    dl = _Download(fetcher, cid, m, peers, FetchStats(), None)
    dl.todo = list(range(N))  # a known order instead of the random one
    return dl, peers


def _holds(dl: _Download, peer: _Peer, chunks: set[int]) -> None:
    """Peer's bitmap as it arrives from ``/have`` (just now)."""
    peer.have = decode_have(encode_have(dl.cid, [i in chunks for i in range(N)]), dl.cid, N)
    peer.complete = len(chunks) == N
    peer.heard_at = time.monotonic()
    dl._notify()


def test_rarest_first_and_the_seed_spared(tmp_path: Path) -> None:
    dl, (seed, a, b) = _setup(tmp_path)
    _holds(dl, seed, set(range(N)))
    _holds(dl, a, {0, 1, 2, 3})
    _holds(dl, b, {2, 3, 4})
    # From a partial holder: the chunk fewest providers hold (1 is held by the seed and a; 2 by all).
    assert dl._pick(a) == 0
    # From the seed: never 1-4 (a partial holder with a free slot gives them), the rarest of the rest.
    assert dl._pick(seed) == 5
    assert dl._pick(seed) == 6 and dl._pick(seed) == 7
    assert dl._pick(seed) is None  # the rest are left to a and b
    assert dl._pick(b) == 4  # only b and the seed hold it
    assert dl._pick(a) == 1
    assert sorted(dl.todo) == [2, 3]
    # While partial holders take part, the seed gets one request of this fetch at a time.
    dl.todo = [7]
    seed.busy = SEED_REQUESTS
    assert dl._pick(seed) is None
    seed.busy = 0
    assert dl._pick(seed) == 7


def test_the_seed_serves_what_a_silent_holder_holds(tmp_path: Path) -> None:
    dl, (seed, a, _) = _setup(tmp_path)
    _holds(dl, seed, set(range(N)))
    _holds(dl, a, set(range(N - 1)))
    dl.todo = [0, 1, 7]
    assert dl._pick(seed) == 7  # only the seed holds it
    a.busy = PER_PROVIDER  # a is busy but sending: its chunks wait for it, the origin's uplink is spared
    assert dl._pick(seed) is None
    a.heard_at = time.monotonic() - SPARE_FRESH_S - 1  # a went silent (frozen, unreachable)
    assert dl._pick(seed) == 0
    a.heard_at = time.monotonic()
    a.dropped = True  # and a dropped provider counts for nothing
    dl.todo = [3]
    dl._notify()
    assert dl._availability()[3] == 1 and dl._pick(seed) == 3


def test_end_game_waits_for_a_slow_link_and_spares_the_seed(tmp_path: Path) -> None:
    """A duplicate is sent only for a request late against this fetch's own chunk times, and to the
    seed only when no responsive partial holder has the chunk."""
    dl, (seed, a, b) = _setup(tmp_path)
    _holds(dl, seed, set(range(N)))
    _holds(dl, a, {0})
    _holds(dl, b, {0})
    dl.todo = []
    # chunk 0 is on its way from b; chunk 1, which only the seed holds, from the seed
    dl.inflight = {0: {"p2": None}, 1: {"p0": None}}  # type: ignore[dict-item]  # None stands for a request in flight
    dl.chunk_seconds, dl.chunks_timed = 10.0, 2  # chunks take 5 s each here
    dl.started[0] = dl.started[1] = time.monotonic() - 6
    assert dl._pick_endgame(a) is None  # 6 s is not late when a chunk takes 5
    dl.started[0] = time.monotonic() - 11
    assert dl._pick_endgame(seed) is None  # a, responsive, holds it: not from the seed
    assert dl._pick_endgame(a) == 0


def test_a_seed_with_nothing_unique_left_is_asked_like_anyone(tmp_path: Path) -> None:
    """Once every chunk this fetch still needs is held by some partial holder, sparing the seed would
    only leave its uplink idle while the last chunks crawl between peers: it is neither spared nor
    limited to one request, and it is asked without X-Blob-If-Idle (it no longer needs pacing)."""
    dl, (seed, a, b) = _setup(tmp_path)
    _holds(dl, seed, set(range(N)))
    _holds(dl, a, {0, 1, 2, 3})
    _holds(dl, b, {2, 3, 4})
    dl.todo = [0, 1, 5]
    assert not dl._seed_has_nothing_unique()  # 5: only the seed has it
    assert dl._pick(seed) == 5 and dl._pick(seed) is None  # 0 and 1 are left to a
    dl.todo = [0, 1]
    dl._notify()
    assert dl._seed_has_nothing_unique()
    seed.busy = SEED_REQUESTS
    assert dl._pick(seed) == 0  # not spared, not limited: its uplink is free
    _holds(dl, a, {1})  # a no longer shows 0 (a stale bitmap, re-asked): the seed has something again
    dl.todo = [0]
    assert not dl._seed_has_nothing_unique()


def test_only_a_seed_with_unique_chunks_is_asked_if_idle(tmp_path: Path) -> None:
    """X-Blob-If-Idle (busy answers, paced turns) goes only to a seed that still holds chunks nobody
    else has; a partial holder serves whoever asks."""
    dl, (seed, a, _b) = _setup(tmp_path)
    asked: list[tuple[str, bool]] = []
    origin = BlobStore(tmp_path / "origin")

    class Recording:
        speaks_if_idle = True

        def accepts(self, provider: object) -> bool:
            return True

        async def read_chunk(self, provider: StaticProvider, cid: str, length: int, sink: ChunkSink, *,
                             if_idle: bool = True) -> None:
            asked.append((provider.peer_id, if_idle))
            sink.write(origin.chunk_path(cid).read_bytes())

    for p in (seed, a):
        p.source = Recording()  # type: ignore[assignment]  # a recording stand-in
    _holds(dl, seed, set(range(N)))
    _holds(dl, a, {0, 1})
    asyncio.run(dl._fetch_one(seed, 5))  # 5 (and 2-4, 6, 7): only the seed has them
    asyncio.run(dl._fetch_one(a, 0))
    dl.todo = [1]
    dl._notify()
    asyncio.run(dl._fetch_one(seed, 1))  # everything still needed is held by a
    assert asked == [("p0", True), ("p1", False), ("p0", False)]
    assert dl.store.has_chunk(dl.m.chunks[5]) and dl.store.has_chunk(dl.m.chunks[1])
