"""No peer input can stop a node's networking (issue #12).

A real target node (runtime with DHT, gossipsub, blob HTTP and the NAT services, relay service on) and
an honest peer on 127.0.0.1; attacker hosts with fresh identities open real streams of every protocol
the node speaks and send malformed, truncated, oversized and seeded random input, hostile pubsub RPCs,
raw TCP garbage at the multistream and Noise stages, and garbage yamux frames inside a valid Noise
session. After each family the target must still serve the honest peer (gossip both ways, a fresh blob
found through the DHT and fetched over HTTP) and the attackers' input must be on record against them.
Inputs are seeded and bounded; nothing here waits on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import random
import struct
from pathlib import Path
from typing import Any

import trio

from tests.support.fuzz import TOPIC, Attackers, assert_serves, hit, target_and_honest
from tests.support.swarm import run
from tests.support.wait import wait_trio

SEED = 12

MESHSUB = ["/meshsub/1.1.0", "/meshsub/1.2.0"]
KAD = "/ipfs/kad/1.0.0"
IDENTIFY, IDENTIFY_PUSH, PING = "/ipfs/id/1.0.0", "/ipfs/id/push/1.0.0", "/ipfs/ping/1.0.0"
AUTONAT = "/libp2p/autonat/1.0.0"
HOP, STOP = "/libp2p/circuit/relay/0.2.0/hop", "/libp2p/circuit/relay/0.2.0/stop"
DCUTR = "/libp2p/dcutr"
INFO, CHUNKS = "/intellect/info/1.0.0", "/intellect/blob-chunk/1.0.0"
SPOKEN = [*MESHSUB, KAD, IDENTIFY, IDENTIFY_PUSH, PING, AUTONAT, HOP, STOP, DCUTR, INFO, CHUNKS]
NOT_SPOKEN = ["/meshsub/1.0.0", "/floodsub/1.0.0"]
"""Offered by other libp2p nodes; ours refuse them in negotiation (we speak meshsub 1.1 and 1.2)."""

SIX_BYTES = bytes.fromhex("05ffffffffff")
"""The issue's reproduction: varint 5, then five 0xff bytes that do not parse as a pubsub RPC."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def stream_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    """Malformed, truncated, oversized and random inputs for one protocol's stream."""
    cases = [
        ("six-bytes", SIX_BYTES),
        ("truncated", _varint(100) + b"abc"),
        ("huge-length", _varint(1 << 40) + b"x" * 16),
        ("bad-varint", b"\xff" * 12),
        ("oversized", _varint(1_300_000) + rng.randbytes(1_300_000)),
        ("empty", b""),
    ]
    for i in range(4):  # random bodies behind a correct length prefix: they reach the decoders
        body = rng.randbytes(rng.randrange(1, 3000))
        cases.append((f"random-framed-{i}", _varint(len(body)) + body))
    for i in range(2):
        cases.append((f"random-{i}", rng.randbytes(rng.randrange(1, 3000))))
    return cases


PARSED = {*MESHSUB, KAD, IDENTIFY_PUSH, AUTONAT, HOP, STOP, CHUNKS}
"""Protocols whose input is parsed, so malformed input is held against the sender. Identify and our
node info only write; ping echoes any 32 bytes; DCUtR closes a stream that arrives on a direct
connection before reading it (nothing to punch)."""


def test_hostile_streams_leave_the_node_serving_honest_peers(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    plan = {proto: stream_cases(rng) for proto in SPOKEN + NOT_SPOKEN}

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            await assert_serves(target, honest, "before", tmp_path)
            book = target.swarm.peerbook
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:

                def attack(proto: str, cases: list[tuple[str, bytes]]) -> Any:
                    async def fn(host: Any, tid: Any) -> list[str]:
                        # Two lanes: ping serves at most two streams per peer at once (it resets more).
                        out: list[str] = [""] * len(cases)
                        lanes = trio.Semaphore(2)

                        async def one(i: int, payload: bytes) -> None:
                            async with lanes:
                                out[i] = await hit(host, tid, proto, payload)

                        async with trio.open_nursery() as nursery:
                            for i, (_name, payload) in enumerate(cases):
                                nursery.start_soon(one, i, payload)
                        return out

                    return attackers.run(fn)

                # One attacker identity per protocol, all at once.
                results = await asyncio.gather(*(attack(p, c) for p, c in plan.items()))
                await assert_serves(target, honest, "after hostile streams", tmp_path)
            for proto, (attacker, ends) in zip(plan, results):
                count, reasons = book.rejections(attacker)
                if proto in NOT_SPOKEN:
                    assert set(ends) == {"refused"}, (proto, ends)
                    continue
                assert "refused" not in ends, (proto, ends)  # every handler got its input
                if proto in PARSED:
                    assert count >= 3 and all(r.startswith(proto) or r.startswith("chunk-stream")
                                              for r in reasons), (proto, count, reasons)
                else:
                    assert count == 0, (proto, reasons)  # input they do not parse is not held against anyone
            six = book.rejections(results[0][0])[1]
            assert any("DecodeError" in r for r in six), six  # the six bytes, contained and blamed

    run(main(), 240)


def hostile_rpcs(rng: random.Random) -> list[tuple[str, bytes]]:
    """Well-framed pubsub RPCs with hostile content."""
    from libp2p.pubsub.pb import rpc_pb2 as pb

    def rpc(**kw: Any) -> bytes:
        raw = pb.RPC(**kw).SerializeToString()
        return _varint(len(raw)) + raw

    def junk(n: int = 40) -> bytes:
        return rng.randbytes(rng.randrange(0, n))

    cases = [
        # An undecodable key on a message of a topic we subscribe: stock push_msg raised in a service
        # task and stopped the pubsub service.
        ("bad-key", rpc(publish=[pb.Message(from_id=b"\x00garbage", data=b"x", seqno=b"1",
                                             topicIDs=[TOPIC], signature=b"sig", key=b"\x00")])),
        ("no-signature", rpc(publish=[pb.Message(from_id=junk(), data=b"y", seqno=junk(),
                                                 topicIDs=[TOPIC])])),
        ("many-subscriptions", rpc(subscriptions=[pb.RPC.SubOpts(subscribe=True, topicid=f"t{i}")
                                                  for i in range(6000)])),
        ("over-per-peer-topics", rpc(subscriptions=[pb.RPC.SubOpts(subscribe=True, topicid=f"u{i}")
                                                    for i in range(150)])),
        ("ihave-flood", rpc(control=pb.ControlMessage(ihave=[pb.ControlIHave(
            topicID=TOPIC, messageIDs=[junk(60) for _ in range(5000)])]))),
        ("iwant-flood", rpc(control=pb.ControlMessage(iwant=[pb.ControlIWant(
            messageIDs=[junk(60) for _ in range(5000)])]))),
        ("graft-unknown", rpc(control=pb.ControlMessage(graft=[pb.ControlGraft(topicID=f"g{i}")
                                                               for i in range(200)]))),
        ("prune-garbage-peers", rpc(control=pb.ControlMessage(prune=[pb.ControlPrune(
            topicID=TOPIC, backoff=(1 << 64) - 1,
            peers=[pb.PeerInfo(peerID=junk(), signedPeerRecord=junk(200)) for _ in range(50)])]))),
        ("sender-record", rpc(senderRecord=junk(500), subscriptions=[pb.RPC.SubOpts(subscribe=True,
                                                                                    topicid=TOPIC)])),
        ("many-topic-ids", rpc(publish=[pb.Message(from_id=junk(), data=b"z", seqno=b"2",
                                                   topicIDs=[TOPIC] + [f"x{i}" for i in range(5000)],
                                                   signature=junk(), key=junk())])),
    ]
    for i in range(20):  # seeded random mixtures
        msgs = [pb.Message(from_id=junk(), data=junk(200), seqno=junk(9), topicIDs=[TOPIC, junk(8).hex()],
                           signature=junk(70), key=junk(40)) for _ in range(rng.randrange(0, 4))]
        ctl = pb.ControlMessage(
            ihave=[pb.ControlIHave(topicID=TOPIC, messageIDs=[junk() for _ in range(rng.randrange(0, 9))])],
            prune=[pb.ControlPrune(topicID=TOPIC, backoff=rng.randrange(0, 1 << 63),
                                   peers=[pb.PeerInfo(peerID=junk(), signedPeerRecord=junk(90))])])
        cases.append((f"mixed-{i}", rpc(publish=msgs, control=ctl, senderRecord=junk(120))))
    return cases


def test_hostile_gossip_rpcs_leave_the_node_serving_honest_peers(tmp_path: Path) -> None:
    cases = hostile_rpcs(random.Random(SEED))

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                async def fn(host: Any, tid: Any) -> list[str]:
                    # One stream per RPC, all at once: a contained failure resets only its own stream.
                    out = [""] * len(cases)

                    async def one(i: int, payload: bytes) -> None:
                        out[i] = await hit(host, tid, MESHSUB[0], payload, timeout=1.0)

                    async with trio.open_nursery() as nursery:
                        for i, (_name, payload) in enumerate(cases):
                            nursery.start_soon(one, i, payload)
                    return out

                attacker, ends = await attackers.run(fn)
                await assert_serves(target, honest, "after hostile RPCs", tmp_path)
            assert "refused" not in ends, ends
            count, reasons = target.swarm.peerbook.rejections(attacker)
            assert any(r.startswith("gossip:") for r in reasons), reasons  # the bad key, blamed on its sender

    run(main(), 180)


async def _raw_tcp_case(host: str, port: int, chunks: list[bytes], *, linger: float = 1.0) -> bytes:
    """Send ``chunks`` over a plain TCP connection (reading what comes back between them), then read for
    up to ``linger`` s and close. The target closing or resetting on us is a fine outcome."""
    reader, writer = await asyncio.open_connection(host, port)
    got = bytearray()
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            try:
                got += await asyncio.wait_for(reader.read(4096), 0.3)
            except asyncio.TimeoutError:
                pass
        while data := await asyncio.wait_for(reader.read(4096), linger):
            got += data
    except (asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
    return bytes(got)


def yamux_frame(typ: int, flags: int, stream_id: int, length: int, body: bytes = b"",
                version: int = 0) -> bytes:
    return struct.pack("!BBHII", version, typ, flags, stream_id, length) + body


def test_garbage_connections_and_yamux_frames_end_only_their_connection(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    ms = b"\x13/multistream/1.0.0\n"
    noise = b"\x07/noise\n"
    tcp_cases = [
        [rng.randbytes(2000)],
        [ms, rng.randbytes(500)],
        [ms, b"\x03\xff\xfe\n"],                      # not UTF-8
        [b"\xff" * 12],                                # a length prefix that never ends
        [ms, b"\x7f" + b"a" * 20],                       # a line that never ends
        [ms, noise, rng.randbytes(300)],                # garbage Noise handshake
        [ms, noise, b"\x00\x20" + rng.randbytes(32)],   # a framed Noise message that is not one
        [ms, noise, b"\xff\xff" + rng.randbytes(1000)], # a Noise frame longer than what follows
        [ms[:7]],                                       # half a header, then gone
    ]
    yamux_cases = {
        "random": rng.randbytes(3000),
        "unknown-type": yamux_frame(9, 0, 1, 10, b"x" * 10),
        "bad-version": yamux_frame(0, 0, 1, 4, b"abcd", version=5),
        "oversized-data": yamux_frame(0, 0, 1, 1 << 31),
        "window-overflow": yamux_frame(1, 0x1, 101, 0xFFFFFFFF) + yamux_frame(1, 0, 101, 0xFFFFFFFF),
        "syn-garbage": b"".join(yamux_frame(0, 0x1, 201 + 2 * i, 16, rng.randbytes(16)) for i in range(200)),
        "data-beyond-window": yamux_frame(1, 0x1, 301, 0) + b"".join(
            yamux_frame(0, 0, 301, 60_000, bytes(60_000)) for _ in range(8)),
        "ping-flood": b"".join(yamux_frame(2, 0x1, 0, i) for i in range(2000)),
        "go-away": yamux_frame(3, 0, 0, 1),
    }

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            addr = target.swarm.listen_addrs()[0]
            port = int(addr.split("/tcp/")[1].split("/")[0])
            await asyncio.gather(*(_raw_tcp_case("127.0.0.1", port, c) for c in tcp_cases),
                                 *(_raw_tcp_case("127.0.0.1", port, [rng.randbytes(300)]) for _ in range(30)))
            await assert_serves(target, honest, "after garbage connections", tmp_path)
            async with Attackers(addr) as attackers:
                def inject(raw: bytes) -> Any:
                    async def fn(host: Any, tid: Any) -> None:
                        # Below yamux: the attacker writes through its Noise session, the target's yamux
                        # read loop parses it.
                        conn = host.get_network().get_connections(tid)[0]
                        with trio.move_on_after(3):
                            try:
                                await conn.muxed_conn.secured_conn.write(raw)
                            except Exception:  # the target may close on us half-way
                                pass
                            while tid in host.get_network().connections:
                                await trio.sleep(0.05)
                    return attackers.run(fn)

                injected = await asyncio.gather(*(inject(raw) for raw in yamux_cases.values()))
                await assert_serves(target, honest, "after garbage yamux frames", tmp_path)
            assert honest.peer_id in target.swarm.connected_peers()
            # Streams opened with garbage instead of multistream are blamed on the session's peer.
            syn = dict(zip(yamux_cases, injected))["syn-garbage"][0]
            count, reasons = target.swarm.peerbook.rejections(syn)
            assert count >= 10 and all(r.startswith("multistream") for r in reasons), (count, reasons)

    run(main(), 180)


def test_a_peer_that_keeps_sending_garbage_is_banned_and_refused(tmp_path: Path) -> None:
    from intellect_node.p2p.peerbook import AUTO_BAN_AFTER

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            book = target.swarm.peerbook
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                async def fn(host: Any, tid: Any) -> tuple[int, str, bool]:
                    me = host.get_id().to_base58()
                    sent = 0
                    while not book.is_banned(me) and sent < AUTO_BAN_AFTER + 20:
                        await hit(host, tid, MESHSUB[0], SIX_BYTES, timeout=1.0)
                        sent += 1
                    with trio.fail_after(10):  # the ban closes its connection
                        while tid in host.get_network().connections:
                            await trio.sleep(0.05)
                    try:  # and it is refused when it comes back
                        with trio.fail_after(10):
                            await host.connect(_info(attackers.target_addr))
                        after = await hit(host, tid, MESHSUB[0], SIX_BYTES, timeout=1.0)
                    except Exception as exc:  # refused already at the connection
                        after = type(exc).__name__
                    return sent, after, book.is_banned(me)

                attacker, (sent, after, banned) = await attackers.run(fn)
            assert banned and sent == AUTO_BAN_AFTER, (sent, banned)
            assert after != "eof", after  # its stream was reset or refused, not served
            assert book.rejections(attacker)[0] == AUTO_BAN_AFTER  # nothing it sent after the ban was read
            await assert_serves(target, honest, "after a ban", tmp_path)

    run(main(), 180)


def _info(addr: str) -> Any:
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    return info_from_p2p_addr(Multiaddr(addr))


def test_a_peer_that_sends_past_its_receive_window_loses_its_connection(tmp_path: Path) -> None:
    """Yamux flow control is the only bound on what a peer can make the node buffer for a stream nobody
    reads. The stock read loop logged a warning and buffered on (10 MiB on one stream, connection kept,
    in an experiment with 40 frames of 256 KiB); the node now closes the connection at the first frame
    past the window and holds it against the sender."""
    from libp2p.network.stream.exceptions import StreamEOF

    frame = 256 * 1024

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                async def fn(host: Any, tid: Any) -> None:
                    # A real stream whose handler has written and closed its side (node info): nothing on
                    # the target reads it again, so only the window bounds what it holds.
                    stream = await host.new_stream(tid, [INFO])
                    with trio.fail_after(10):
                        try:
                            while await stream.read(1 << 16):
                                pass
                        except StreamEOF:  # the info is written and the target's side closed
                            pass
                    muxed = stream.muxed_stream
                    with trio.move_on_after(10):
                        try:
                            for _ in range(40):  # 10 MiB, ignoring the window the target granted
                                await muxed.conn._write_frame(
                                    yamux_frame(0, 0, muxed.stream_id, frame, bytes(frame)))
                        except Exception:  # the target closed on us: what the test wants
                            pass
                    await wait_trio(lambda: tid not in host.get_network().connections, 10,
                                    what="the target to close the connection")
                    assert tid not in host.get_network().connections, "the target kept the connection"

                attacker, _ = await attackers.run(fn)
            count, reasons = target.swarm.peerbook.rejections(attacker)
            beyond = [r for r in reasons if r.startswith("yamux:")]
            assert len(beyond) == 1, reasons
            excess = int(beyond[0].split()[1])
            assert 0 < excess <= frame, beyond  # caught at the first frame past the window
            await assert_serves(target, honest, "after a window overrun", tmp_path)

    run(main(), 180)


def test_a_frame_announced_past_the_window_closes_the_connection_before_its_body_is_read(
        tmp_path: Path) -> None:
    """The stock read loop reads a DATA frame's whole body (up to 16 MiB) before it counts it against the
    window. A header announcing 1 MiB on a stream with at most 256 KiB of window, and no body: the target
    refuses the frame from its header alone (it would otherwise wait for the body) and closes the
    connection, on a stream it knows and on a new one (SYN, whose window is the initial 256 KiB)."""
    announced = 1 << 20

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            book = target.swarm.peerbook
            for syn in (False, True):
                async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                    async def fn(host: Any, tid: Any) -> None:
                        muxer = host.get_network().get_connections(tid)[0].muxed_conn
                        if syn:
                            sid, flags = 10_001, 0x1
                        else:
                            stream = await host.new_stream(tid, [INFO])
                            sid, flags = stream.muxed_stream.stream_id, 0
                        await muxer._write_frame(yamux_frame(0, flags, sid, announced))  # the header alone
                        await wait_trio(lambda: tid not in host.get_network().connections, 30,
                                        what="the target to close the connection")

                    attacker, _ = await attackers.run(fn)
                reasons = [r for r in book.rejections(attacker)[1] if r.startswith("yamux:")]
                assert len(reasons) == 1 + syn, (syn, book.rejections(attacker))  # one key, two attacks
                excess = int(reasons[-1].split()[1])
                assert announced - 256 * 1024 <= excess < announced, (syn, reasons)
            await assert_serves(target, honest, "after frames announced past the window", tmp_path)

    run(main(), 180)


def test_data_for_an_unknown_stream_is_drained_and_the_connection_keeps_serving(tmp_path: Path) -> None:
    """A DATA frame for a stream the target does not know (what arrives after it reset a stream) is read and
    dropped in pieces (``compat.DRAIN_PIECE``), then the read loop goes on: a 4 MiB body for an unknown
    stream, then a node-info request on the same connection, answered. Nothing is held against the sender:
    honest peers send such frames when a reset crosses their data."""
    body = (4 << 20) + 123  # not a whole number of pieces

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            book = target.swarm.peerbook
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                async def fn(host: Any, tid: Any) -> tuple[int, bool]:
                    from libp2p.network.stream.exceptions import StreamEOF
                    from libp2p.stream_muxer.exceptions import MuxedStreamEOF

                    conn = host.get_network().get_connections(tid)[0]
                    await conn.muxed_conn._write_frame(yamux_frame(0, 0, 40_001, body, bytes(body)))
                    got = b""
                    with trio.fail_after(30):  # the answer comes only once the read loop is past the body
                        stream = await host.new_stream(tid, [INFO])
                        try:
                            while piece := await stream.read(1 << 16):
                                got += piece
                        except (StreamEOF, MuxedStreamEOF):
                            pass
                    return len(got), tid in host.get_network().connections

                attacker, (answered, connected) = await attackers.run(fn)
            assert answered > 0 and connected
            assert not [r for r in book.rejections(attacker)[1] if r.startswith("yamux:")]
            await assert_serves(target, honest, "after data for an unknown stream", tmp_path)

    run(main(), 180)


def test_the_drain_reads_an_unknown_streams_body_in_pieces_and_nothing_after_it() -> None:
    """The unit under the test above: every read is at most ``DRAIN_PIECE`` bytes, the frame's body is
    consumed exactly (the next frame's bytes stay), and nothing is returned for the stream."""
    from types import SimpleNamespace

    from trio.testing import memory_stream_pair

    from intellect_node.p2p import compat

    length = 5 * compat.DRAIN_PIECE + 123

    class Reader:  # the read interface of a secured connection, over a real in-memory trio stream
        def __init__(self, stream: Any) -> None:
            self.stream = stream
            self.sizes: list[int] = []
            self._intellect_yamux_header = yamux_frame(0, 0, 7, length)

        async def read(self, n: int) -> bytes:
            self.sizes.append(n)
            return bytes(await self.stream.receive_some(n))

    async def main() -> tuple[bytes, list[int], bytes]:
        send, receive = memory_stream_pair()
        reader = Reader(receive)
        await send.send_all(bytes(length) + b"next")
        muxer: Any = SimpleNamespace(secured_conn=reader, streams={})  # what the read asks of a Yamux
        got = await compat._read_body_within_window(muxer, length)
        return got, reader.sizes, bytes(await receive.receive_some(4))

    got, sizes, rest = trio.run(main)
    assert got == b"" and rest == b"next"
    assert sizes and max(sizes) <= compat.DRAIN_PIECE


def test_streams_the_peer_closed_are_forgotten_once_their_handlers_return(tmp_path: Path) -> None:
    """Pubsub's read loop and the relay's HOP handler return on the peer's EOF without closing their own
    side; the stock library then keeps each such stream in the connection's table until the connection
    closes, uncounted by the stream cap (the peer can no longer send on it), so a peer could grow that
    table by opening and closing streams. The dispatcher closes our side once the handler has returned
    (``guard._finish``): 40 streams each of meshsub 1.1, meshsub 1.2 and HOP, each closed by the attacker
    at once, and the target's table for that connection empties while the connection stays up."""
    per_protocol = 40

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            net = target.swarm.p2p.host.get_network()  # read from the attacker's thread: len() only
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                async def fn(host: Any, tid: Any) -> int:
                    me = host.get_id()

                    def held() -> int:  # streams of this connection in the target's muxer
                        return sum(len(c.muxed_conn.streams) for c in list(net.connections.get(me) or []))

                    for proto in [*MESHSUB, HOP]:
                        for _ in range(per_protocol):
                            stream = await host.new_stream(tid, [proto])
                            await stream.close()
                    await wait_trio(lambda: held() == 0, 60, what="the target to forget the closed streams")
                    assert tid in host.get_network().connections
                    return held()

                await attackers.run(fn)
            await assert_serves(target, honest, "after streams closed by the peer", tmp_path)

    run(main(), 180)


def test_a_peer_that_holds_too_many_streams_open_gets_the_next_ones_reset(tmp_path: Path) -> None:
    """Each inbound stream may hold up to its receive window that nobody reads; only a cap on the streams
    a connection holds open bounds the total. 300 raw SYNs, each negotiating node info (whose handler
    writes and returns) and never closed: the streams past guard.MAX_INBOUND_STREAMS are reset and held
    against the sender, the target keeps serving."""
    from intellect_node.p2p.guard import MAX_INBOUND_STREAMS

    n = MAX_INBOUND_STREAMS + 44
    hello = b"\x13/multistream/1.0.0\n"
    ask = _varint(len(INFO) + 1) + INFO.encode() + b"\n"

    async def main() -> None:
        async with target_and_honest(tmp_path / "nodes") as (target, honest):
            book = target.swarm.peerbook
            async with Attackers(target.swarm.listen_addrs()[0]) as attackers:
                async def fn(host: Any, tid: Any) -> None:
                    muxer = host.get_network().get_connections(tid)[0].muxed_conn
                    me = host.get_id().to_base58()
                    for i in range(n):  # odd IDs: the dialer's; far above what its own streams use
                        sid = 10_001 + 2 * i
                        await muxer._write_frame(yamux_frame(1, 0x1, sid, 0))
                        await muxer._write_frame(yamux_frame(0, 0, sid, len(hello + ask), hello + ask))
                    await wait_trio(lambda: book.rejections(me)[0] >= n - MAX_INBOUND_STREAMS, 60,
                                    what="the streams past the cap refused")

                attacker, _ = await attackers.run(fn)
            count, reasons = book.rejections(attacker)
            assert count == n - MAX_INBOUND_STREAMS, (count, reasons[:3])
            assert all(r.startswith("streams:") for r in reasons), reasons[:3]
            await assert_serves(target, honest, "after a stream flood", tmp_path)

    run(main(), 180)
