"""What a provider holds back and what it holds open (``blobs/http.py``): a seed's turns
(``SeedPacer``: chunks asked ``X-Blob-If-Idle`` start one at a time, a send gives up its turn after its
solo time, waiting is bounded, plain requests are never paced) and bitmap requests held open until the
next chunk lands (``/have?after=``). Real aiohttp servers on 127.0.0.1 for the served paths; the
pacer's own rules on the event loop."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

from aiohttp import web

from intellect_node.blobs.fetch import StaticProvider
from intellect_node.blobs.http import HttpChunkSource
from intellect_node.blobs.pacing import SeedPacer
from intellect_node.blobs.peer import BlobPeer
from intellect_node.protocol.blob import HTTP_PREFIX, decode_have, encode_have
from tests.support.wait import wait_until


def test_turns_one_at_a_time_bounded_and_never_leaked() -> None:
    async def main() -> None:
        pacer = SeedPacer(max_waiting=1, max_turn_s=3600.0)
        first = await pacer.turn()
        assert first is not None and pacer.held == 1
        second = asyncio.ensure_future(pacer.turn())
        await wait_until(lambda: len(pacer._waiters) == 1, what="the second asker to queue")
        assert await pacer.turn() is None  # the queue is full: answered busy at once
        first.release()
        first.release()  # idempotent: a turn passes on once
        got = await second
        assert got is not None and pacer.held == 1
        # A waiter cancelled (its client went away) leaves no turn behind.
        third = asyncio.ensure_future(pacer.turn())
        await wait_until(lambda: len(pacer._waiters) == 1, what="the third asker to queue")
        third.cancel()
        await asyncio.gather(third, return_exceptions=True)
        got.release()
        assert pacer.held == 0 and not pacer._waiters
        # One asker cannot fill the queue: past max_per_asker waiting requests it is answered busy.
        busy = SeedPacer(max_per_asker=2, max_turn_s=3600.0)
        taken = await busy.turn("10.0.0.1")
        waits = [asyncio.ensure_future(busy.turn("10.0.0.1")) for _ in range(2)]
        await wait_until(lambda: len(busy._waiters) == 2, what="two requests of one asker to queue")
        assert await busy.turn("10.0.0.1") is None
        other = asyncio.ensure_future(busy.turn("10.0.0.2"))  # another asker still queues
        await wait_until(lambda: len(busy._waiters) == 3, what="another asker to queue")
        assert taken is not None
        taken.release()
        for w in [*waits, other]:
            t = await w
            assert t is not None
            t.release()
        assert busy.held == 0 and not busy._waiting_by
        # Waiting longer than max_wait_s is answered busy, and the turn is still there for the next.
        slow = SeedPacer(max_wait_s=0.05, max_turn_s=3600.0)
        held = await slow.turn()
        assert held is not None and await slow.turn() is None
        held.release()
        assert slow.held == 0

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_send_gives_up_its_turn_after_its_solo_time() -> None:
    """Once a rate was measured, a send still running after size / that rate (its receiver's downlink
    is busy) lets the next one start: the seed's uplink is never held idle by a slow receiver."""
    async def main() -> None:
        pacer = SeedPacer(max_turn_s=3600.0)
        pacer.best_rate = 1e9  # bytes/s: a 1 MB send would take a millisecond alone
        first = await pacer.turn()
        assert first is not None
        nxt = asyncio.ensure_future(pacer.turn())
        first.start(1_000_000)  # ...and is still running
        assert await asyncio.wait_for(nxt, 10) is not None
        first.end(1_000_000, ok=True)  # ending later hands nothing back twice
        assert pacer.held == 1

    asyncio.run(asyncio.wait_for(main(), 30))


def test_if_idle_requests_wait_their_turn_plain_requests_do_not(tmp_path: Path) -> None:
    big = 16 << 20  # larger than the socket buffers, so a send to a reader that does not drain stays open
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(2 * big))

    async def main() -> None:
        origin = await BlobPeer(tmp_path / "o").start()
        origin.blobs.serve_stats.pacer.max_turn_s = 3600.0  # only the send's end passes the turn on
        origin.blobs.serve_stats.busy_after_send_s = 0.0  # the plain send below does not make c1 busy
        try:
            _, m = await origin.blobs.put_file(src, chunk_size=big)
            c0, c1 = m.chunks
            host, port = origin.url.removeprefix("http://").split(":")
            loop = asyncio.get_running_loop()
            slow = socket.socket()
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            slow.setblocking(False)
            await loop.sock_connect(slow, (host, int(port)))
            await loop.sock_sendall(slow, f"GET {HTTP_PREFIX}/chunk/{c0} HTTP/1.1\r\nHost: x\r\n"
                                          "X-Blob-If-Idle: 1\r\n\r\n".encode())
            stats = origin.blobs.serve_stats
            await wait_until(lambda: c0 in stats.sending, what="the slow send to hold the turn")
            source = HttpChunkSource()
            got = bytearray()

            class Collect:
                def write(self, piece: bytes | bytearray | memoryview) -> None:
                    got.extend(piece)

            waiting = asyncio.ensure_future(source.read_chunk(origin.as_provider(), c1, big, Collect()))
            await wait_until(lambda: len(stats.pacer._waiters) == 1, what="the if-idle request to queue")
            plain = bytearray()

            class Plain:
                def write(self, piece: bytes | bytearray | memoryview) -> None:
                    plain.extend(piece)

            # A partial holder's request (no X-Blob-If-Idle) is served while the turn is held.
            await source.read_chunk(origin.as_provider(), c1, big, Plain(), if_idle=False)
            assert bytes(plain) == src.read_bytes()[big:] and not waiting.done()
            slow.close()  # the send ends: its turn passes to the waiting request
            await asyncio.wait_for(waiting, 30)
            assert bytes(got) == src.read_bytes()[big:]
            # The client has every byte once the server's last write is out; the server hands the turn
            # back only after that write returns, so the turn's end is awaited, not assumed.
            await wait_until(lambda: stats.pacer.held == 0, what="the served request to give its turn back")
            assert stats.busy == 0 and not stats.pacer._waiters
            source.close()
        finally:
            await origin.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_bitmap_request_waits_for_the_next_chunk(tmp_path: Path) -> None:
    """``/have?after=<version>`` is held open until the provider commits a chunk (then answered with
    the new bitmap and version), or until its wait ends; malformed parameters are refused; a provider
    without the header (an earlier version) yields no version, so the fetcher polls it."""
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(4 * 1024))

    async def main() -> None:
        origin = await BlobPeer(tmp_path / "o").start()
        holder = await BlobPeer(tmp_path / "h").start()
        source = HttpChunkSource()
        try:
            cid, m = await origin.blobs.put_file(src, chunk_size=1024)
            holder.blobs.store.put_manifest(cid, origin.blobs.store.manifest_bytes(cid) or b"")
            raw, version = await source.get_have_after(holder.as_provider(), cid, None, 30.0)
            assert version is not None and decode_have(raw, cid, 4).held() == 0
            # Nothing new within the wait: the same bitmap and version come back.
            assert await source.get_have_after(holder.as_provider(), cid, version, 0.05) == (raw, version)
            waiting = asyncio.ensure_future(source.get_have_after(holder.as_provider(), cid, version, 30.0))
            stats = holder.blobs.serve_stats
            await wait_until(lambda: stats.have_waiters == 1, what="the bitmap request to be held open")
            writer = holder.blobs.store.open_chunk_writer(m.chunks[2], 1024)
            writer.write(origin.blobs.store.chunk_path(m.chunks[2]).read_bytes())
            writer.commit()  # the holder got chunk 2
            raw2, version2 = await asyncio.wait_for(waiting, 30)
            assert version2 is not None and version2 > version
            assert [i for i in range(4) if decode_have(raw2, cid, 4).has(i)] == [2]
            assert stats.have_waiters == 0
            for bad in ("after=x", "after=1&wait_ms=-5", "after=" + "9" * 40):
                body = await asyncio.to_thread(_get_status, f"{holder.url}{HTTP_PREFIX}/have/{cid}?{bad}")
                assert body == 400, bad
        finally:
            source.close()
            await origin.stop()
            await holder.stop()

        async def earlier_version(_: web.Request) -> web.Response:  # answers at once, no version
            return web.Response(body=encode_have(cid, [True] * 4))

        app = web.Application()
        app.add_routes([web.get(f"{HTTP_PREFIX}/have/{{cid}}", earlier_version)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
        old = HttpChunkSource()
        try:
            earlier = StaticProvider("p", f"http://127.0.0.1:{port}")
            raw, version = await old.get_have_after(earlier, cid, 7, 30.0)
            assert version is None and decode_have(raw, cid, 4).held() == 4
        finally:
            old.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
