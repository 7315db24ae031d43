"""The blob HTTP layer's lean paths: the chunk response (HEAD, a vanished chunk), the body deadline that
moves with the bytes, receive buffers handed on once, and the CID cache that never caches a refusal."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from intellect_node.blobs import http as blob_http
from intellect_node.blobs.fetch import StaticProvider
from intellect_node.blobs.http import HttpChunkSource, _Collect, _Conn
from intellect_node.errors import ProtocolError, TransportError
from intellect_node.protocol.blob import HTTP_PREFIX
from intellect_node.protocol.ids import BLAKE3, cid_of, validate_cid
from tests.blobs.test_blobs_fetch import Node


async def _raw(url: str, request: str) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request.encode())
    await writer.drain()
    data = await reader.read()  # the request says Connection: close
    writer.close()
    return data


def test_chunk_route_head_and_a_chunk_gone_from_disk(tmp_path: Path) -> None:
    src = tmp_path / "b.bin"
    src.write_bytes(os.urandom(3 * 4096))

    async def main() -> None:
        node = await Node(tmp_path / "n").start()
        try:
            _, m = await node.svc.put_file(src, chunk_size=4096)
            head = await _raw(node.url, f"HEAD {HTTP_PREFIX}/chunk/{m.chunks[0]} HTTP/1.1\r\nHost: x\r\n"
                                        "Connection: close\r\n\r\n")
            status, _, rest = head.partition(b"\r\n")
            assert b" 200 " in status and b"content-length: 4096" in rest.lower()
            assert rest.endswith(b"\r\n\r\n")  # the headers alone, no body
            got = await _raw(node.url, f"GET {HTTP_PREFIX}/chunk/{m.chunks[1]} HTTP/1.1\r\nHost: x\r\n"
                                       "Connection: close\r\n\r\n")
            assert got.endswith(src.read_bytes()[4096:8192]) and b" 200 " in got.split(b"\r\n")[0]
            node.svc.store.chunk_path(m.chunks[2]).unlink()  # gone from disk, still in the index
            gone = await _raw(node.url, f"GET {HTTP_PREFIX}/chunk/{m.chunks[2]} HTTP/1.1\r\nHost: x\r\n"
                                        "Connection: close\r\n\r\n")
            assert b" 404 " in gone.split(b"\r\n")[0]
            assert node.svc.serve_stats.chunks == 2 and not node.svc.serve_stats.sending
        finally:
            await node.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


async def _dribbler(pieces: int, gap: asyncio.Event | float, body: bytes) -> tuple[asyncio.Server, str]:
    """An HTTP server that answers any request with ``body`` in ``pieces`` parts, ``gap`` seconds apart
    (or, for an Event, stops after the first part until the event is set)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        step = -(-len(body) // pieces)
        for i in range(0, len(body), step):
            writer.write(body[i:i + step])
            await writer.drain()
            if isinstance(gap, asyncio.Event):
                await gap.wait()
            else:
                await asyncio.sleep(gap)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_body_deadline_moves_with_the_bytes_and_catches_silence() -> None:
    """A provider that keeps sending, slower than the whole read timeout in total, is read to the end;
    one that goes silent fails within the read timeout (a deadline per body, pushed back as bytes come)."""
    body = os.urandom(64 * 1024)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server, url = await _dribbler(8, 0.5, body)  # 8 parts, 0.5 s apart: 3.5 s > read_timeout
        source = HttpChunkSource(read_timeout=3.0)
        out = _Collect()
        t0 = loop.time()
        status, _ = await source._get(StaticProvider("p", url), "/x", sink=out, check_length=lambda n: None)
        assert status == 200 and bytes(out.data) == body and loop.time() - t0 > 3.0
        server.close()
        never = asyncio.Event()
        server, url = await _dribbler(8, never, body)  # one part, then silence
        t0 = loop.time()
        with pytest.raises(TransportError, match="TimeoutError"):
            await source._get(StaticProvider("p", url), "/x", sink=_Collect(), check_length=lambda n: None)
        assert 2.0 < loop.time() - t0 < 30  # read_timeout, less up to one extension step (0.75 s)
        never.set()
        server.close()
        source.close()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_a_closed_connections_buffer_is_handed_on_once() -> None:
    blob_http._SPARE_BUFFERS.clear()
    a, b = socket.socketpair()
    try:
        conn = _Conn(a)
        buf = conn.buf
        conn.close()
        conn.close()  # a second close must not hand the same buffer on twice
        assert blob_http._SPARE_BUFFERS == [buf] and len(conn.view) == 0
        c1, c2 = _Conn(socket.socket()), _Conn(socket.socket())
        assert c1.buf is buf and c2.buf is not buf  # two live connections never share one
        c1.close()
        c2.close()
    finally:
        b.close()
        blob_http._SPARE_BUFFERS.clear()


def test_cid_cache_never_keeps_a_refusal() -> None:
    good = cid_of(b"x", BLAKE3)
    for _ in range(2):  # the second time from the cache
        assert validate_cid(good) == good
    b32 = "abcdefghijklmnopqrstuvwxyz234567"
    not_canonical = good[:-1] + b32[b32.index(good[-1]) ^ 1]
    for bad in [not_canonical, good.upper(), good[:-1], "b" + "!" * (len(good) - 1)]:
        for _ in range(2):
            with pytest.raises(ProtocolError):
                validate_cid(bad)
    for not_a_string in [None, 5, [good], good.encode()]:
        with pytest.raises(ProtocolError):
            validate_cid(not_a_string)  # type: ignore[arg-type]  # a wrong type on purpose


def test_fetchers_that_know_only_the_seed_are_not_told_busy(tmp_path: Path) -> None:
    """Three peers fetch a new one-chunk blob at once, each knowing only the publisher (what a DHT lookup
    right after an announcement gives). None is answered busy: with nobody else to take the chunk from,
    "ask again later" would only queue them for the seed one after another."""
    from intellect_node.blobs.peer import BlobPeer

    src = tmp_path / "delta.bin"
    src.write_bytes(os.urandom(300_000))

    async def main() -> None:
        seed = await BlobPeer(tmp_path / "seed").start()
        fetchers = [await BlobPeer(tmp_path / f"f{i}").start() for i in range(3)]
        try:
            cid, _ = await seed.blobs.put_file(src)
            for f in fetchers:
                f.providers = [seed.as_provider()]
            stats = await asyncio.gather(*(f.blobs.fetch(cid) for f in fetchers))
            assert [s.busy_answers for s in stats] == [0, 0, 0]
            assert seed.blobs.serve_stats.busy == 0 and seed.blobs.serve_stats.chunks == 3
            for f in fetchers:
                assert not f.blobs.store.missing(cid)
        finally:
            for p in [seed, *fetchers]:
                await p.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_fetch_that_knows_only_the_seed_finds_partial_holders_while_it_downloads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three peers fetch a many-chunk blob whose first provider lookup names only the publisher, as right
    after an announcement. The publisher's uplink is slow. Looking again during the download, each finds
    the others (partial holders by then) and takes chunks from them: the publisher sends fewer than
    three copies."""
    from intellect_node.blobs import fetch as fetch_mod
    from intellect_node.blobs.fetch import Provider
    from intellect_node.blobs.peer import BlobPeer

    monkeypatch.setattr(fetch_mod, "REDISCOVER_DURING_S", 0.5)
    chunk, n_chunks = 64 * 1024, 48
    src = tmp_path / "ckpt.bin"
    src.write_bytes(os.urandom(chunk * n_chunks))

    class SlowFromSeed(HttpChunkSource):
        """The publisher's uplink: every chunk from it takes 0.1 s more."""

        def __init__(self, seed_url: str) -> None:
            super().__init__()
            self.seed_url = seed_url

        def accepts(self, provider: object) -> bool:
            return getattr(provider, "http_url", None) == self.seed_url

        async def read_chunk(self, provider: object, cid: str, length: int, sink: Any, *,
                             if_idle: bool = True) -> None:
            await asyncio.sleep(0.1)
            await super().read_chunk(provider, cid, length, sink, if_idle=if_idle)

    async def main() -> None:
        seed = await BlobPeer(tmp_path / "seed").start()
        slow = [SlowFromSeed(seed.url) for _ in range(3)]
        fetchers = [await BlobPeer(tmp_path / f"f{i}", extra_sources=[slow[i]]).start() for i in range(3)]
        lookups = [0, 0, 0]
        try:
            cid, _ = await seed.blobs.put_file(src, chunk_size=chunk)

            def finder(i: int) -> Any:
                async def find(_cid: str) -> list[Provider]:
                    lookups[i] += 1
                    if lookups[i] == 1:
                        return [seed.as_provider()]  # the first lookup: only the publisher
                    return [seed.as_provider(), *(f.as_provider() for f in fetchers)]
                return find

            for i, f in enumerate(fetchers):
                f.blobs._fetcher._find = finder(i)  # type: ignore[union-attr]  # set by now
            stats = await asyncio.gather(*(f.blobs.fetch(cid) for f in fetchers))
            for f in fetchers:
                assert not f.blobs.store.missing(cid)
            from_peers = sum(n for s in stats for p, n in s.by_provider.items() if p != seed.key.peer_id)
            assert all(n >= 2 for n in lookups), lookups
            assert from_peers > 0 and seed.blobs.serve_stats.chunks < 3 * n_chunks
        finally:
            for p in [seed, *fetchers]:
                await p.stop()
            for s in slow:
                s.close()

    asyncio.run(asyncio.wait_for(main(), 120))
