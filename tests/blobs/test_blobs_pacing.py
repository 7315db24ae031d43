"""A seed's turns (``blobs/http.py``'s ``SeedPacer``): chunks asked of it ``X-Blob-If-Idle`` start one
at a time, a send gives up its turn after its solo time, waiting is bounded, and plain requests (a
partial holder's, an earlier version's) are never paced. Real aiohttp servers on 127.0.0.1 for the
served path; the pacer's own rules on the event loop."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from intellect_node.blobs.http import HttpChunkSource, SeedPacer
from intellect_node.blobs.peer import BlobPeer
from intellect_node.protocol.blob import HTTP_PREFIX
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
            assert stats.pacer.held == 0 and stats.busy == 0
            source.close()
        finally:
            await origin.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
