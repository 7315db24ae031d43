"""The py-libp2p workarounds (p2p/compat.py): each defect shown on the stock code where that can
be done deterministically, and the fix shown on real hosts over loopback.

The corrupt pubsub frames honest nodes sent under load (issue #12) come from ``YamuxStream.write``:
it holds the stream's write lock per frame, so a second writer's message lands between the frames of a
first one that needed several (longer than a frame, or than the send window left); and a write that
fails part-way leaves a truncated message on an open stream, which the next message then follows.
"""

from __future__ import annotations

import ast
import hashlib
import os
from typing import Any

import pytest
import trio
import trio.testing

from intellect_node.p2p import compat as compat
from tests.support.common import REPO
from tests.support.swarm import run, swarm_nodes
from tests.support.wait import wait_until

PROTO = "/intellect-test/frames/1.0.0"


def _host(i: int) -> Any:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    kp = create_new_key_pair(hashlib.sha256(f"compat-{i}-{os.getpid()}".encode()).digest())
    return new_host(key_pair=kp, sec_opt={PROTOCOL_ID: Transport(kp, x25519().private_key)})


def _pair() -> tuple[Any, Any, list[Any], Any]:
    """Two real hosts to run on 127.0.0.1: (a, b, listen addrs, info_from_p2p_addr)."""
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    return _host(1), _host(2), [Multiaddr("/ip4/127.0.0.1/tcp/0")], info_from_p2p_addr


async def _read_messages(stream: Any, n: int, out: list[Any]) -> None:
    """Read ``n`` varint-framed messages into ``out``; a failure is recorded as the last item."""
    from libp2p.utils.varint import read_varint_prefixed_bytes_limited

    try:
        for _ in range(n):
            out.append(await read_varint_prefixed_bytes_limited(stream, 1 << 22))
    except Exception as exc:  # what the reader makes of the stream is the observation
        out.append(exc)


def _interleave_scenario(write: Any) -> list[Any]:
    """Writer A sends a 200 KB message (four frames); right after its first frame goes out, writer B
    sends a 100-byte message on the same stream. Returns what the reader parsed."""
    from libp2p.stream_muxer.yamux import yamux
    from libp2p.utils.varint import encode_varint_prefixed

    big = encode_varint_prefixed(b"A" * 200_000)
    small = encode_varint_prefixed(b"B" * 100)
    got: list[Any] = []
    write_frame = yamux.Yamux._write_frame

    async def main() -> None:
        a, b, listen, info = _pair()
        done = trio.Event()

        async def handler(stream: Any) -> None:
            await _read_messages(stream, 2, got)
            done.set()

        async with a.run(listen), b.run(listen), trio.open_nursery() as nursery:
            a.set_stream_handler(PROTO, handler)
            await b.connect(info(a.get_addrs()[0]))
            stream = await b.new_stream(a.get_id(), [PROTO])
            muxed = stream.muxed_stream
            first = [True]

            async def observed(self: Any, data: bytes) -> None:
                await write_frame(self, data)
                if first[0] and data[1] == yamux.TYPE_DATA and len(data) > 60_000:
                    first[0] = False  # A's first frame is out: B writes now, and runs as far as it can
                    nursery.start_soon(write, muxed, small)
                    await trio.testing.wait_all_tasks_blocked(0.05)

            yamux.Yamux._write_frame = observed  # type: ignore[method-assign]  # every Yamux's, for this test
            try:
                await write(muxed, big)
            finally:
                yamux.Yamux._write_frame = write_frame  # type: ignore[method-assign]  # restored / wrapped as above
            with trio.move_on_after(10):
                await done.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return got


def test_stock_yamux_write_interleaves_concurrent_messages() -> None:
    # The defect, on the unpatched write: the reader takes A's length, then B's frame as part of A.
    # When this fails, upstream fixed it: drop "yamux-atomic-writes" from compat.
    got = _interleave_scenario(compat.stock("YamuxStream.write"))
    assert len(got) == 2 and isinstance(got[0], bytes) and b"B" * 100 in got[0], got[:1]


def test_yamux_writes_whole_messages_atomically() -> None:
    compat.apply_fixes()
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    got = _interleave_scenario(YamuxStream.write)
    assert got == [b"A" * 200_000, b"B" * 100]


def _partial_write_scenario(fixed: bool) -> tuple[bytes, BaseException | None, BaseException | None]:
    """The receiver stops reading; the sender's window runs down to 1000 bytes; a 5000-byte message is
    cancelled after its first ~950 bytes went out (the window left after negotiation); then a next message
    is written on the same stream and the stream is closed. Returns the raw bytes the reader got after the
    first (filler) message, how its reading ended (None: a clean EOF) and what the second write raised."""
    from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

    compat.apply_fixes()
    from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, YamuxStream

    write = YamuxStream.write if fixed else compat.stock("YamuxStream.write")
    filler = encode_varint_prefixed(b"F" * (DEFAULT_WINDOW_SIZE - 1000 - 3))
    assert len(filler) == DEFAULT_WINDOW_SIZE - 1000
    raw = bytearray()
    ended: list[BaseException | None] = [None]
    second: list[BaseException | None] = [None]

    async def main() -> None:
        a, b, listen, info = _pair()
        go, done = trio.Event(), trio.Event()

        async def handler(stream: Any) -> None:
            await go.wait()
            try:
                assert await read_varint_prefixed_bytes_limited(stream, 1 << 20) == filler[3:]
                while chunk := await stream.read(1 << 16):
                    raw.extend(chunk)
            except Exception as exc:  # EOF or reset: how the stream ended is the observation
                ended[0] = None if "EOF" in type(exc).__name__ else exc
            done.set()

        async with a.run(listen), b.run(listen):
            a.set_stream_handler(PROTO, handler)
            await b.connect(info(a.get_addrs()[0]))
            stream = await b.new_stream(a.get_id(), [PROTO])
            muxed = stream.muxed_stream
            await write(muxed, filler)
            with trio.move_on_after(10) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write, muxed, encode_varint_prefixed(b"P" * 5000))
                    while muxed.send_window > 0:  # its first 1000 bytes went out; it waits for credit
                        await trio.sleep(0.01)
                    scope.cancel()  # e.g. the caller's deadline
            go.set()
            try:
                await write(muxed, encode_varint_prefixed(b"N" * 50))
                await muxed.close()
            except Exception as exc:  # the fixed stream refuses: it was reset
                second[0] = exc
            with trio.fail_after(15):
                await done.wait()

    trio.run(main)
    return bytes(raw), ended[0], second[0]


def test_stock_yamux_partial_write_is_followed_by_the_next_message() -> None:
    # The defect: the truncated message stays on the open stream and the next one follows it, so the
    # reader's framing takes the next message as the rest of the truncated one.
    raw, ended, second = _partial_write_scenario(fixed=False)
    assert second is None and ended is None
    head, tail = raw[:-51], raw[-51:]  # 5000 announced; the window let ~950 of them out, then N follows
    assert head[:2] == b"\x88\x27" and set(head[2:]) == {ord("P")} and 500 < len(head) < 1002, len(head)
    assert tail == b"\x32" + b"N" * 50


def test_a_partly_written_message_resets_the_stream() -> None:
    from libp2p.stream_muxer.exceptions import MuxedStreamError

    raw, ended, second = _partial_write_scenario(fixed=True)
    assert isinstance(second, MuxedStreamError), second  # never written to again
    # The reader sees a reset (yamux drops what was buffered and unread when a reset arrives), and no
    # byte of the next message ever follows the truncated one.
    assert ended is not None and "Reset" in type(ended).__name__, ended
    assert b"N" not in raw


def test_a_failed_pubsub_write_resets_its_stream_and_pubsub_opens_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that stops crediting its window: the write times out, the stream is reset (its reader
    sees a reset, no unparsable frame), pubsub opens a new stream and the next message arrives."""
    monkeypatch.setattr(compat, "WINDOW_WAIT_TIMEOUT_S", 0.5)
    topic = "/intellect/test/compat/1"

    async def main() -> None:
        async with swarm_nodes(2, {0: [1]}) as (a, b):
            got: list[bytes] = []
            for n in (a, b):
                n.subscribe(topic, lambda data, origin: data, lambda msg, origin: got.append(msg))
            await wait_until(lambda: b.peer_id in a.topic_peers(topic) and a.peer_id in b.topic_peers(topic),
                             20, what="subscriptions")
            from libp2p.peer.id import ID

            pid = ID.from_base58(b.peer_id)

            async def starve() -> Any:
                stream = a.p2p.pubsub.peers[pid]
                stream.muxed_stream.send_window = 0  # as if b had stopped reading
                return stream

            old = await a.bridge.call(starve)
            await a.publish(topic, b"lost: its stream was starved")

            async def replaced() -> bool:
                cur = a.p2p.pubsub.peers.get(pid)
                return cur is not None and cur is not old

            async def poll() -> None:
                with trio.fail_after(20):
                    while not await replaced():
                        await trio.sleep(0.05)

            await a.bridge.call(poll)
            assert old.muxed_stream.closed and old.muxed_stream.send_closed  # reset: never written again
            await a.publish(topic, b"after the reset")
            await wait_until(lambda: b"after the reset" in got, 20, what="delivery on the new stream")
            assert b.peerbook.rejections(a.peer_id) == (0, [])  # nothing unparsable reached b

    run(main(), 90)


def test_a_failing_connection_task_ends_only_its_connection() -> None:
    """Without containment a dispatcher failure (what any handler bug looked like) stops the Swarm
    service; with it only the failing connection closes and the other peers are still served."""
    compat.apply_fixes()
    from libp2p.host.ping import ID as PING
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    async def main() -> None:
        target, bad, good = _host(11), _host(12), _host(13)
        listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with target.run(listen), bad.run(listen), good.run(listen):
            network = target.get_network()
            dispatch = network.common_stream_handler

            async def buggy(stream: Any) -> None:
                if stream.muxed_conn.peer_id == bad.get_id():
                    raise RuntimeError("a handler bug")
                await dispatch(stream)

            network.set_stream_handler(buggy)  # no stream containment here: the connection guard acts
            await good.connect(info_from_p2p_addr(target.get_addrs()[0]))
            await bad.connect(info_from_p2p_addr(target.get_addrs()[0]))
            try:
                with trio.fail_after(10):
                    s = await bad.new_stream(target.get_id(), [PING])
                    await s.write(b"x" * 32)
                    await s.read(32)
            except Exception:  # the failing connection is closed under it
                pass
            with trio.fail_after(10):
                while bad.get_id() in target.get_network().connections:
                    await trio.sleep(0.05)
            with trio.fail_after(10):
                s = await good.new_stream(target.get_id(), [PING])
                await s.write(b"p" * 32)
                assert await s.read(32) == b"p" * 32
            assert target.get_network().manager.is_running

    trio.run(main)


def test_honest_bulk_streams_to_slow_readers_stay_within_the_receive_window() -> None:
    """The receive-window check closes a connection at the first byte past the window
    (yamux-receive-window), so our own credits must never grant more than the window holds: several
    concurrent streams of 4 MiB each, written in 1 MiB messages (the window auto-tunes up) to readers that
    take 8 KiB at a time and pause, arrive intact on the same connection."""
    compat.apply_fixes()
    a, b, listen, info = _pair()
    proto = "/intellect-test/bulk/1.0.0"
    payloads = [os.urandom(4 * 1024 * 1024) for _ in range(4)]
    got: dict[int, bytes] = {}

    async def main() -> None:
        async def reader(stream: Any) -> None:
            head = await stream.read(1)
            buf = bytearray()
            while len(buf) < len(payloads[0]):
                buf += await stream.read(8192)
                if len(buf) % (256 * 1024) < 8192:
                    await trio.sleep(0.002)
            got[head[0]] = bytes(buf)

        async with a.run(listen), b.run(listen):
            a.set_stream_handler(proto, reader)
            await b.connect(info(a.get_addrs()[0]))

            async def send(i: int) -> None:
                s = await b.new_stream(a.get_id(), [proto])
                await s.write(bytes([i]))
                for k in range(0, len(payloads[i]), 1 << 20):
                    await s.write(payloads[i][k:k + (1 << 20)])

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i in range(len(payloads)):
                        nursery.start_soon(send, i)
                while len(got) < len(payloads):
                    await trio.sleep(0.01)
            muxers = [h.get_network().get_connections(p)[0].muxed_conn
                      for h, p in ((a, b.get_id()), (b, a.get_id()))]
            assert [getattr(m, "_window_exceeded", None) for m in muxers] == [None, None]
            assert not any(m.is_closed for m in muxers)

    trio.run(main)
    assert [got[i] == payloads[i] for i in range(len(payloads))] == [True] * len(payloads)


def test_stock_pubsub_outbound_queue_rejects_past_32_rpcs() -> None:
    """Pubsub builds each peer's queue with no size, so the stock one refuses the 33rd queued RPC (a burst
    a stalled forwarder accepted is lost); ours, the one pubsub now builds, holds PEER_OUTBOUND_QUEUE."""
    from libp2p.pubsub import pubsub
    from libp2p.pubsub.pb import rpc_pb2

    compat.apply_fixes()

    def accepted(queue: Any, n: int) -> int:
        return sum(queue.push(rpc_pb2.RPC()) for _ in range(n))

    assert accepted(compat.stock("pubsub.RpcQueue")(), 40) == 32
    assert accepted(pubsub.RpcQueue(), compat.PEER_OUTBOUND_QUEUE + 8) == compat.PEER_OUTBOUND_QUEUE


def test_the_workaround_table_names_real_tests() -> None:
    names = [w.name for w in compat.WORKAROUNDS]
    assert len(names) == len(set(names))
    for w in compat.WORKAROUNDS:
        assert all([w.where, w.defect, w.evidence, w.upstream, w.remove_when]), w.name
        path, _, func = w.test.partition("::")
        tree = ast.parse((REPO / path).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in defined, f"{w.name}: {w.test} does not exist"
    doc = (REPO / "docs" / "libp2p.md").read_text()
    assert all(f"`{n}`" in doc for n in names), "docs/libp2p.md lists every workaround"


def test_another_libp2p_version_is_refused_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.9.0")
    with pytest.raises(ImportError, match=r"needs libp2p==0\.8\.1, found 0\.9\.0"):
        compat._check_version()
