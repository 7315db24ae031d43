"""Swarming fetch over real aiohttp servers on 127.0.0.1: parallel providers, a malicious one, partial
holders, and a provider that announces more bytes than the chunk has."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any, Sequence

import pytest
from aiohttp import web

from intellect_node.blobs.fetch import Progress, Provider, StaticProvider
from intellect_node.blobs.http import ChunkBusy, HttpChunkSource
from intellect_node.blobs.service import BlobService
from intellect_node.blobs.store import BlobStore
from intellect_node.p2p.peerbook import PeerBook
from intellect_node.protocol.blob import HTTP_PREFIX
from intellect_node.protocol.signing import SigningKey

CHUNK = 16 * 1024


async def _serve(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
    return runner, f"http://127.0.0.1:{port}"


class Node:
    """A blob service with its own store, key and HTTP server; providers are whatever the test says."""

    def __init__(self, root: Path, *, read_timeout: float = 15.0) -> None:
        self.providers: list[Provider] = []
        self.rejections: list[tuple[str, str]] = []
        key = SigningKey.generate()
        self.book = PeerBook(key.peer_id)  # the swarm's peerbook, as the node wires it

        async def find(cid: str) -> Sequence[Provider]:
            return list(self.providers)

        def penalise(peer: str, why: str) -> None:
            self.rejections.append((peer, why))
            self.book.record_rejection(peer, why)

        self.provided: list[tuple[str, int]] = []  # (blob cid, chunks still missing when announced)

        async def provide(cid: str) -> None:
            m = self.svc.store.manifest(cid)
            self.provided.append((cid, len(self.svc.store.missing(cid)) if m else -1))

        self.svc = BlobService(BlobStore(root), key, find_providers=find, provide=provide,
                               penalise=penalise, is_banned=self.book.is_banned, read_timeout=read_timeout)
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def peer_id(self) -> str:
        return self.svc.key.peer_id

    def as_provider(self) -> StaticProvider:
        return StaticProvider(self.peer_id, self.url)

    async def start(self, routes: list[web.RouteDef] | None = None) -> "Node":
        self._runner, self.url = await _serve(routes if routes is not None else self.svc.routes())
        await self.svc.start()
        return self

    async def stop(self) -> None:
        await self.svc.close()
        if self._runner is not None:
            await self._runner.cleanup()


async def _until(predicate: Any, what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` on the loop until it holds (never a fixed sleep as a wait)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _copy_blob(src: BlobStore, dst: BlobStore, cid: str, indices: Sequence[int] | None = None) -> None:
    """Give ``dst`` the manifest and (some) chunks of ``cid`` as if it had fetched them."""
    m = src.manifest(cid)
    assert m is not None
    dst.put_manifest(cid, src.manifest_bytes(cid) or b"")
    for i in indices if indices is not None else range(len(m.chunks)):
        c = m.chunks[i]
        dst.chunk_path(c).write_bytes(src.chunk_path(c).read_bytes())
        dst.mark_chunk(c)


def _mallory_routes(store: BlobStore, served: list[str]) -> list[web.RouteDef]:
    """Honest manifest and bitmap, every chunk with one byte flipped."""
    honest = {r.path: r.handler for r in BlobService(store, SigningKey.generate()).routes()}

    async def bad_chunk(request: web.Request) -> web.StreamResponse:
        cid = request.match_info["cid"]
        data = bytearray(store.chunk_path(cid).read_bytes())
        data[len(data) // 2] ^= 0xFF
        served.append(cid)
        return web.Response(body=bytes(data))

    return [web.get(f"{HTTP_PREFIX}/manifest/{{cid}}", honest[f"{HTTP_PREFIX}/manifest/{{cid}}"]),
            web.get(f"{HTTP_PREFIX}/have/{{cid}}", honest[f"{HTTP_PREFIX}/have/{{cid}}"]),
            web.get(f"{HTTP_PREFIX}/chunk/{{cid}}", bad_chunk)]


def test_three_providers_one_corrupt(tmp_path: Path) -> None:
    data = os.urandom(64 * CHUNK + 123)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = await Node(tmp_path / "origin").start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        honest = Node(tmp_path / "honest")
        _copy_blob(origin.svc.store, honest.svc.store, cid)
        await honest.start()
        mstore = BlobStore(tmp_path / "mallory")
        _copy_blob(origin.svc.store, mstore, cid)
        bad_served: list[str] = []
        mallory_key = SigningKey.generate()
        mallory_runner, mallory_url = await _serve(_mallory_routes(mstore, bad_served))
        fetcher = await Node(tmp_path / "fetcher").start()
        # Mallory is listed first: its workers start before the honest ones get everything.
        fetcher.providers = [StaticProvider(mallory_key.peer_id, mallory_url), origin.as_provider(),
                             honest.as_provider()]
        seen: list[Progress] = []
        stats = await fetcher.svc.fetch(cid, out=tmp_path / "out.bin", on_progress=seen.append)
        assert (tmp_path / "out.bin").read_bytes() == data
        assert bad_served, "mallory was never asked for a chunk"
        assert {p for p, _ in fetcher.rejections} == {mallory_key.peer_id}  # once per bad chunk
        count, reasons = fetcher.book.rejections(mallory_key.peer_id)
        assert count >= 1 and "does not match its hash" in reasons[0]
        assert mallory_key.peer_id in stats.bad and mallory_key.peer_id not in stats.by_provider
        # Both honest providers took part, and the corrupted chunk was fetched from one of them.
        assert set(stats.by_provider) == {origin.peer_id, honest.peer_id}
        assert stats.chunks_fetched == len(m.chunks) and len(seen) == len(m.chunks)
        assert sorted(p.index for p in seen) == list(range(len(m.chunks)))
        assert seen[-1].bytes_done == len(data) and seen[-1].chunks_done == len(m.chunks)
        # Once the node bans mallory, a later fetch does not even ask it.
        served_before = len(bad_served)
        later = await Node(tmp_path / "later").start()
        later.book.ban(mallory_key.peer_id, "served corrupted chunks")
        later.providers = fetcher.providers
        stats = await later.svc.fetch(cid)
        assert len(bad_served) == served_before and mallory_key.peer_id not in stats.failures
        for n in (origin, honest, fetcher, later):
            await n.stop()
        await mallory_runner.cleanup()

    asyncio.run(main())


def test_partial_holders_and_serving_while_downloading(tmp_path: Path) -> None:
    """B holds only the even chunks, C only the odd ones (the origin is gone): the fetch combines them.
    Then D fetches from the fetcher alone, which serves what it holds."""
    data = os.urandom(20 * CHUNK)
    src = tmp_path / "f.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = Node(tmp_path / "o")
        await origin.svc.start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        b, c = Node(tmp_path / "b"), Node(tmp_path / "c")
        _copy_blob(origin.svc.store, b.svc.store, cid, range(0, 20, 2))
        _copy_blob(origin.svc.store, c.svc.store, cid, range(1, 20, 2))
        await b.start()
        await c.start()
        f = await Node(tmp_path / "f").start()
        f.providers = [b.as_provider(), c.as_provider()]
        stats = await f.svc.fetch(cid)
        assert stats.by_provider == {b.peer_id: 10, c.peer_id: 10} and not stats.failures
        d = await Node(tmp_path / "d").start()
        d.providers = [f.as_provider()]
        await d.svc.fetch(cid, out=tmp_path / "d.bin")
        assert (tmp_path / "d.bin").read_bytes() == data
        assert f.svc.serve_stats.chunks == 20
        for n in (b, c, f, d):
            await n.stop()
        await origin.svc.close()

    asyncio.run(main())


def test_resume_in_process_and_oversize_announcement(tmp_path: Path) -> None:
    """A store that already holds some chunks asks only for the rest; a provider whose Content-Length
    exceeds the chunk is treated as malicious before any byte is written."""
    data = os.urandom(10 * CHUNK)
    src = tmp_path / "f.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = await Node(tmp_path / "o").start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        f = Node(tmp_path / "f")
        _copy_blob(origin.svc.store, f.svc.store, cid, range(7))
        await f.start()

        async def too_long(request: web.Request) -> web.StreamResponse:
            return web.Response(body=b"x" * (CHUNK + 1))

        liar_key = SigningKey.generate()
        honest = {r.path: r.handler for r in origin.svc.routes()}
        liar_runner, liar_url = await _serve([
            web.get(f"{HTTP_PREFIX}/have/{{cid}}", honest[f"{HTTP_PREFIX}/have/{{cid}}"]),
            web.get(f"{HTTP_PREFIX}/chunk/{{cid}}", too_long)])
        f.providers = [StaticProvider(liar_key.peer_id, liar_url), origin.as_provider()]
        stats = await f.svc.fetch(cid, out=tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == data
        assert stats.chunks_resumed == 7 and stats.chunks_fetched == 3
        assert set(origin.svc.serve_stats.requests_by_cid) <= set(m.chunks[7:])
        assert liar_key.peer_id in stats.bad and "announced" in stats.bad[liar_key.peer_id]
        await f.stop()
        await origin.stop()
        await liar_runner.cleanup()

    asyncio.run(main())


def test_control_routes_put_and_get(tmp_path: Path) -> None:
    """The control API's put/get (mounted here on a bare app; the node mounts them behind its token)."""
    import aiohttp

    data = os.urandom(5 * CHUNK + 7)
    src = tmp_path / "f.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = await Node(tmp_path / "o").start()
        ctl_runner, ctl_url = await _serve(origin.svc.control_routes())
        f = await Node(tmp_path / "f").start()
        f.providers = [origin.as_provider()]
        f_runner, f_url = await _serve(f.svc.control_routes())
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{ctl_url}/v1/blob/put", json={"path": str(src), "chunk_size": CHUNK}) as r:
                assert r.status == 200
                put: dict[str, Any] = await r.json()
            async with s.post(f"{ctl_url}/v1/blob/put", json={"path": "relative.bin"}) as r:
                assert r.status == 400
            events = []
            get = {"cid": put["cid"], "out": str(tmp_path / "o.bin")}
            async with s.post(f"{f_url}/v1/blob/get", json=get) as r:
                async for line in r.content:
                    events.append(__import__("json").loads(line))
            async with s.post(f"{f_url}/v1/blob/get", json={"cid": "nope"}) as r:
                assert r.status == 400
        assert events[0]["event"] == "manifest" and events[0]["chunks_total"] == 6
        kinds = [e["event"] for e in events[1:]]
        # Six chunks, then the file written out (progress while --out is written and synced), then done.
        assert kinds[:6] == ["chunk"] * 6 and kinds[-1] == "done" and set(kinds[6:-1]) <= {"writing"}, kinds
        assert (tmp_path / "o.bin").read_bytes() == data
        for n in (origin, f):
            await n.stop()
        await ctl_runner.cleanup()
        await f_runner.cleanup()

    asyncio.run(main())


def test_downloader_announces_and_serves_before_it_is_complete(tmp_path: Path) -> None:
    """F fetches from an origin that stalls after 4 chunks; F announces the blob at once, and G, which
    knows only F, gets those 4 chunks from F while F is still incomplete, then the rest once F has them."""
    n_chunks, first = 12, 4
    data = os.urandom(n_chunks * CHUNK)
    src = tmp_path / "f.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = Node(tmp_path / "o")
        await origin.svc.start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        gate = asyncio.Event()
        served = 0
        routes = {r.path: r.handler for r in origin.svc.routes()}
        chunk_route = f"{HTTP_PREFIX}/chunk/{{cid}}"

        async def gated(request: web.Request) -> web.StreamResponse:
            nonlocal served
            served += 1
            if served > first:
                await gate.wait()
            return await routes[chunk_route](request)

        runner, url = await _serve([web.get(p, gated if p == chunk_route else h) for p, h in routes.items()])
        f = await Node(tmp_path / "f").start()
        f.providers = [StaticProvider(origin.peer_id, url)]
        g = await Node(tmp_path / "g").start()
        g.providers = [f.as_provider()]
        f_task = asyncio.ensure_future(f.svc.fetch(cid))
        await _until(lambda: f.svc.store.manifest(cid) is not None
                     and len(m.chunks) - len(f.svc.store.missing(cid)) >= first, "F holds the first chunks")
        assert f.provided and f.provided[0] == (cid, n_chunks)  # announced before its first chunk
        g_progress: list[int] = []
        g_task = asyncio.ensure_future(g.svc.fetch(cid, on_progress=lambda p: g_progress.append(p.index)))
        await _until(lambda: len(g_progress) >= first, "G got F's chunks")
        assert f.svc.store.missing(cid), "F finished early: the origin gate did not hold"
        gate.set()
        await f_task
        stats = await g_task
        assert stats.by_provider == {f.peer_id: n_chunks}
        g.svc.store.export(cid, tmp_path / "g.bin")
        assert (tmp_path / "g.bin").read_bytes() == data
        for n in (f, g):
            await n.stop()
        await origin.svc.close()
        await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_chunk_being_sent_is_busy_for_if_idle_requests(tmp_path: Path) -> None:
    """While a provider sends a chunk to one peer (a reader that does not drain it), and a moment after,
    a request for the same chunk with ``X-Blob-If-Idle`` is answered busy; one without the header (an
    earlier version) is served; after that moment the chunk is served again."""
    big = 16 << 20  # larger than the socket buffers, so the first send stays in progress
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(big))

    async def main() -> None:
        origin = await Node(tmp_path / "o").start()
        cid, m = await origin.svc.put_file(src, chunk_size=big)
        chunk = m.chunks[0]
        host, port = origin.url.removeprefix("http://").split(":")
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(slow, (host, int(port)))
        await loop.sock_sendall(slow, f"GET {HTTP_PREFIX}/chunk/{chunk} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await _until(lambda: chunk in origin.svc.serve_stats.sending, "the slow transfer to start")
        source = HttpChunkSource()
        sink = origin.svc.store.open_chunk_writer(chunk, big)  # any sink: nothing may reach it
        with pytest.raises(ChunkBusy):
            await source.read_chunk(origin.as_provider(), chunk, big, sink)
        assert sink.received == 0 and origin.svc.serve_stats.busy == 1
        sink.abort()
        got = bytearray()

        class Collect:
            def write(self, piece: bytes | bytearray | memoryview) -> None:
                got.extend(piece)

        status, _ = await source._get(origin.as_provider(), f"{HTTP_PREFIX}/chunk/{chunk}", sink=Collect(),
                                      check_length=lambda n: None)  # an earlier version's request
        assert status == 200 and bytes(got) == src.read_bytes()
        origin.svc.serve_stats.busy_after_send_s = 3600.0  # "a moment ago" lasts the whole test
        slow.close()
        await _until(lambda: not origin.svc.serve_stats.sending, "the slow transfer to end")
        sink = origin.svc.store.open_chunk_writer(chunk, big)
        with pytest.raises(ChunkBusy):  # its receiver holds it now: ask that peer
            await source.read_chunk(origin.as_provider(), chunk, big, sink)
        sink.abort()
        origin.svc.serve_stats.busy_after_send_s = 0.0
        f = await Node(tmp_path / "f").start()
        f.providers = [origin.as_provider()]
        stats = await f.svc.fetch(cid, out=tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == src.read_bytes() and stats.busy_answers == 0
        source.close()
        for n in (origin, f):
            await n.stop()

    asyncio.run(main())


def test_a_blob_under_the_announce_floor_gets_no_provider_record(tmp_path: Path) -> None:
    """``put_file(announce_min_chunks=N)``: the roles' small blobs (a rollout batch, a policy delta), whose
    fetchers are told the holder, cost no DHT announcement; a blob of N chunks or more is announced, and
    the small one is still served."""
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small.write_bytes(os.urandom(3 * CHUNK))
    big.write_bytes(os.urandom(4 * CHUNK))

    async def main() -> None:
        origin = await Node(tmp_path / "o").start()
        small_cid, _ = await origin.svc.put_file(small, chunk_size=CHUNK, announce_min_chunks=4)
        big_cid, _ = await origin.svc.put_file(big, chunk_size=CHUNK, announce_min_chunks=4)
        await origin.svc.settle()
        assert [cid for cid, _ in origin.provided] == [big_cid]
        fetcher = await Node(tmp_path / "f").start()
        fetcher.providers = [origin.as_provider()]  # the holder named by the notice
        await fetcher.svc.fetch(small_cid, out=tmp_path / "got.bin")
        assert (tmp_path / "got.bin").read_bytes() == small.read_bytes()
        for n in (fetcher, origin):
            await n.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
