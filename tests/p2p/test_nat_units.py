"""NAT parts that need no namespaces: the AutoNAT verdict, the chunk-stream protocol between two real
libp2p hosts on loopback (honest, tampered and hostile peers, the relay budget), and the NAT service in
a real node runtime serving a blob over libp2p to a ``p2p://`` provider fetch."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.p2p.nat import chunk_stream
from intellect_node.p2p.nat.autonat import Reachability, decide, fix_text
from intellect_node.protocol import codec, gossip
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey


def test_verdict_needs_agreeing_answers_and_says_what_to_do() -> None:
    assert decide(2, 0, 2) is Reachability.PUBLIC
    assert decide(0, 3, 2) is Reachability.PRIVATE
    assert decide(1, 0, 2) is Reachability.UNKNOWN  # one answer is not enough
    assert decide(2, 2, 2) is Reachability.UNKNOWN  # a tie is no verdict
    assert decide(3, 1, 2) is Reachability.PUBLIC
    private = fix_text(Reachability.PRIVATE, 4001, relayed=True)
    assert "forward TCP port 4001" in private and "a relay is used" in private
    assert "no relay reservation yet" in fix_text(Reachability.PRIVATE, 4001, relayed=False)



def test_private_node_heartbeat_with_p2p_url_is_accepted_only_for_its_signer() -> None:
    # A node behind NAT advertises p2p://<own peer ID>; peers once rejected that heartbeat as a bad
    # URL, so private nodes were never heard (seen in the join-in-namespaces test).
    key, other = SigningKey(bytes(range(32))), SigningKey(bytes(range(1, 33)))
    now = 1_800_000_000_000

    def hb(url: str) -> bytes:
        return key.seal(gossip.HEARTBEAT_DOMAIN, gossip.Heartbeat(
            run_id="r1", seq=1, time_ms=now, http_url=url,
            listen_addrs=[f"/ip4/1.2.3.4/tcp/1/p2p/{other.peer_id}/p2p-circuit/p2p/{key.peer_id}"]))

    got, signer = gossip.open_heartbeat(hb(f"p2p://{key.peer_id}"), run_id="r1", now_ms=now)
    assert got.http_url == f"p2p://{key.peer_id}" and signer == key.peer_id
    for bad in (f"p2p://{other.peer_id}", "p2p://", "ftp://x"):  # another node's ID, none, other scheme
        with pytest.raises(ProtocolError, match="bad http_url"):
            gossip.open_heartbeat(hb(bad), run_id="r1", now_ms=now)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_chunk_stream_messages_decode_strictly(data: bytes) -> None:
    for t in (chunk_stream.ChunkRequest, chunk_stream.ChunkResponse):
        try:
            codec.decode(data, t, max_size=chunk_stream.MAX_REQUEST)
        except ProtocolError:
            pass


class _Conn:
    """What the relay budget reads of a muxed connection (libp2p's IMuxedConn): its addresses."""

    def __init__(self, addr: str) -> None:
        self.addr = addr

    def get_transport_addresses(self) -> list[str]:
        return [self.addr]


def test_relay_budget_is_three_quarters_of_the_known_limit_and_128k_when_unknown() -> None:
    relay = "12D3KooWLPq2K2XR348udqwMRu1Ep3HrvUJMCjUcUAbxRsxNVenp"
    # The budget needs neither a host nor a chunk source; the connections are _Conn stand-ins.
    srv: Any = chunk_stream.ChunkStreamServer(None, None,  # type: ignore[arg-type]  # needs neither
                                              relay_limits=lambda r: 4 << 20 if r == relay else None)
    relayed = _Conn(f"/p2p/{relay}/p2p-circuit/p2p/12D3KooWSeyV2Z8qh4kpc2MhzrYkRqxrYrNTZ9FGaw1hPGtW1MhD")
    assert srv.budget_left(relayed) == 3 << 20
    other = _Conn("/p2p/12D3KooWJonFBTWvYjixNLtsGgQFe3nrQfJF2uXCe6WVaMBAkRBj/p2p-circuit/p2p/x")
    assert srv.budget_left(other) == int(chunk_stream.UNKNOWN_RELAY_LIMIT * chunk_stream.BUDGET_SHARE)
    assert srv.budget_left(_Conn("/ip4/10.0.0.1/tcp/4001")) is None  # direct: no budget


def _host(i: int) -> Any:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    kp = create_new_key_pair(hashlib.sha256(f"nat-unit-{i}-{os.getpid()}".encode()).digest())
    return new_host(key_pair=kp, sec_opt={PROTOCOL_ID: Transport(kp, x25519().private_key)})


def test_chunks_over_a_libp2p_stream_honest_tampered_and_hostile() -> None:
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    good = os.urandom(300_000)
    cid = cid_of(good)
    store: dict[str, bytes] = {cid: good}
    rejected: list[tuple[str, str]] = []

    async def lookup(kind: str, c: str) -> bytes | None:
        return store.get(c) if kind == "chunk" else None

    async def main() -> None:
        a, b = _host(1), _host(2)
        listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with a.run(listen), b.run(listen):
            chunk_stream.ChunkStreamServer(a, lookup,
                                           on_reject=lambda p, r: rejected.append((p, r))).register()
            await b.connect(info_from_p2p_addr(a.get_addrs()[0]))
            client = chunk_stream.ChunkStreamClient(b, a.get_id(), timeout=10)
            assert await client.get_chunk(cid) == good
            assert await client.get("chunk", cid_of(b"absent")) is None
            # A tampered store: the bytes no longer match the CID they are served under.
            store[cid] = good[:-1] + bytes([good[-1] ^ 1])
            with pytest.raises(IntegrityError):
                await client.get_chunk(cid)
            # More than the caller allows: refused before reading the body.
            store[cid] = good
            with pytest.raises(ProtocolError):
                await client.get("chunk", cid, max_size=1000)
            # A hostile requester: an oversize frame and garbage are rejected and blamed, the server lives.
            from intellect_node.p2p.nat.chunk_stream import PROTOCOL_ID

            for junk in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x05hello"):
                s = await b.new_stream(a.get_id(), [PROTOCOL_ID])
                await s.write(junk)
                with trio.fail_after(10):
                    try:
                        await s.read(10)
                    except Exception:  # the server resets the stream: what we want
                        pass
            assert await client.get_chunk(cid) == good

    trio.run(main)
    assert len(rejected) == 2 and all("chunk-stream" in r for _, r in rejected)


def test_a_peer_has_a_bounded_number_of_chunk_streams_served_at_once() -> None:
    """A peer has at most MAX_STREAMS_PER_PEER chunk streams being served at once; the next is answered
    ``busy`` before its item is looked up, another peer is still served, and once the held streams end
    the first peer is served again. Real hosts; the held streams wait inside the lookup (a gate the test
    opens), so nothing here depends on how long the library lets a stalled write wait."""
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from intellect_node.errors import TransportError

    item = os.urandom(1 << 16)
    cid = cid_of(item)
    gate = trio.Event()
    entered: list[str] = []
    held = trio.Event()

    async def lookup(kind: str, c: str) -> bytes | None:
        entered.append(c)
        if len(entered) <= chunk_stream.MAX_STREAMS_PER_PEER:  # the first peer's streams wait here
            if len(entered) == chunk_stream.MAX_STREAMS_PER_PEER:
                held.set()
            await gate.wait()
        return item if c == cid else None

    async def main() -> None:
        a, b, c = _host(11), _host(12), _host(13)
        listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with a.run(listen), b.run(listen), c.run(listen):
            server = chunk_stream.ChunkStreamServer(a, lookup)
            server.register()
            await b.connect(info_from_p2p_addr(a.get_addrs()[0]))
            await c.connect(info_from_p2p_addr(a.get_addrs()[0]))
            waiting = []
            for _ in range(chunk_stream.MAX_STREAMS_PER_PEER):
                s = await b.new_stream(a.get_id(), [chunk_stream.PROTOCOL_ID])
                await s.write(chunk_stream._frame(codec.encode(chunk_stream.ChunkRequest(kind="chunk",
                                                                                         cid=cid))))
                waiting.append(s)
            with trio.fail_after(60):
                await held.wait()
            with pytest.raises(TransportError, match="busy"):
                await chunk_stream.ChunkStreamClient(b, a.get_id(), timeout=30).get_chunk(cid)
            assert server.refused_busy == 1 and len(entered) == chunk_stream.MAX_STREAMS_PER_PEER
            # another peer is served meanwhile
            assert await chunk_stream.ChunkStreamClient(c, a.get_id(), timeout=30).get_chunk(cid) == item
            for s in waiting:
                await s.reset()
            gate.set()
            with trio.fail_after(60):
                while str(b.get_id()) in server._active:
                    await trio.sleep(0.01)
            assert await chunk_stream.ChunkStreamClient(b, a.get_id(), timeout=30).get_chunk(cid) == item
            assert server.serving_bytes == 0

    trio.run(main)


class _StalledStream:
    """A chunk stream whose reader asked for an item and never reads: its write waits on ``unblock``."""

    class _Conn:
        def __init__(self, peer: str) -> None:
            self.peer_id = peer

        def get_transport_addresses(self) -> list[Any]:
            return []

    def __init__(self, peer: str, cid: str, unblock: trio.Event) -> None:
        self.muxed_conn = self._Conn(peer)
        self._request = chunk_stream._frame(codec.encode(chunk_stream.ChunkRequest(kind="chunk", cid=cid)))
        self.unblock = unblock
        self.writing = trio.Event()
        self.written = b""
        self.was_reset = False

    async def read(self, n: int) -> bytes:
        out, self._request = self._request[:n], self._request[n:]
        return out

    async def write(self, data: bytes) -> None:
        self.writing.set()
        await self.unblock.wait()
        self.written += data

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.was_reset = True


def test_items_held_by_readers_that_do_not_read_are_counted_and_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk stream holds its whole item while the reader reads it: the item's bytes count in
    ``serving_bytes`` from the lookup until the write ends, and past MAX_SERVING_BYTES (all peers
    together) the next request is ``busy`` without being read; once the readers read (or go), the
    count returns to 0. In-process: a stream whose write waits on the test stands for a reader that
    stopped reading."""
    big = os.urandom(3 << 20)
    cid = cid_of(big)
    looked_up: list[str] = []

    async def lookup(kind: str, c: str) -> bytes | None:
        looked_up.append(c)
        return big if c == cid else None

    monkeypatch.setattr(chunk_stream, "MAX_SERVING_BYTES", 2 * len(big))

    async def main() -> None:
        server = chunk_stream.ChunkStreamServer(None, lookup)  # type: ignore[arg-type]  # a stand-in for it
        unblock = trio.Event()
        streams = [_StalledStream(f"peer-{i}", cid, unblock) for i in range(3)]
        async with trio.open_nursery() as nursery:
            for s in streams[:2]:
                nursery.start_soon(server.handle, s)
                await s.writing.wait()
            assert server.serving_bytes == 2 * len(big)  # held while the writes wait
            nursery.start_soon(server.handle, streams[2])
            await streams[2].writing.wait()  # the busy answer is written at once
            assert len(looked_up) == 2 and server.refused_busy == 1
            unblock.set()
        assert server.serving_bytes == 0 and not server._active
        assert all(s.written.endswith(big) for s in streams[:2])
        assert b"busy" in streams[2].written and not streams[2].written.endswith(big)

    trio.run(main)


def test_node_runtime_serves_a_blob_to_a_p2p_provider_fetch(tmp_path: Path) -> None:
    """The NAT service inside real node runtimes (loopback, so AutoNAT has no verdict): a fetch from a
    ``p2p://`` provider goes over the libp2p chunk stream and is hash-checked into the store."""
    from intellect_node.blobs.fetch import StaticProvider
    from intellect_node.blobs.service import BlobService
    from intellect_node.p2p.nat.service import NatService
    from tests.support.swarm import run, runtime_nodes

    holder: dict[int, Any] = {}

    def nat_factory(rt: Any) -> Any:
        svc = NatService.for_runtime(rt)
        holder[id(rt)] = svc
        return svc

    def blob_factory(rt: Any) -> Any:
        nat = holder[id(rt)]
        svc = BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board, extra_sources=[nat.source])
        nat.attach_blob_store(lambda: svc.store)
        return svc

    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(2 * 1024 * 1024 + 5))

    async def main() -> None:
        services = [nat_factory, blob_factory]
        async with runtime_nodes(tmp_path / "nodes", 2, {0: [1]}, services=services) as rts:
            blobs = [next(s for s in rt.services if isinstance(s, BlobService)) for rt in rts]
            cid, _ = await blobs[0].put_file(str(src), chunk_size=1 << 20)
            peer0 = rts[0].swarm.peer_id
            fetcher = blobs[1]
            assert fetcher._fetcher is not None
            # Only the p2p source can take this provider: HTTP is not offered.
            fetcher._fetcher._find = _static([StaticProvider(peer0, f"p2p://{peer0}")])
            await fetcher.fetch(cid, out=str(tmp_path / "out.bin"))
            assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
            st = rts[0].status()["nat"]
            assert st["reachability"] == "UNKNOWN"
            assert st["chunk_stream"]["served_bytes"] >= src.stat().st_size

    run(main(), timeout=120)


def test_a_role_fetches_from_a_holder_that_advertises_p2p(tmp_path: Path) -> None:
    """The roles' fetcher (``HintedFetcher``: a validator fetching a worker's batch, the trainer a
    verdict) takes the blob service's libp2p source: a holder behind NAT advertises ``p2p://<peer>`` in
    its heartbeats. With HTTP alone every such fetch found "no providers" and the validator rejected the
    NATed worker's batches as unavailable, then banned it (seen in ``test_run_by_cid_nat.py``)."""
    from intellect_node.blobs.service import BlobService
    from intellect_node.p2p.nat.service import NatService
    from intellect_node.roles.common.fetch import HintedFetcher
    from tests.support.swarm import run, runtime_nodes
    from tests.support.wait import wait_until

    holder: dict[int, Any] = {}

    def nat_factory(rt: Any) -> Any:
        holder[id(rt)] = svc = NatService.for_runtime(rt)
        return svc

    def blob_factory(rt: Any) -> Any:
        nat = holder[id(rt)]
        svc = BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board, extra_sources=[nat.source])
        nat.attach_blob_store(lambda: svc.store)
        return svc

    src = tmp_path / "batch.bin"
    src.write_bytes(os.urandom(300_000))

    async def main() -> None:
        async with runtime_nodes(tmp_path / "nodes", 2, {0: [1]}, services=[nat_factory, blob_factory],
                                 heartbeat_interval=1.0) as rts:
            blobs = [next(s for s in rt.services if isinstance(s, BlobService)) for rt in rts]
            cid, _ = await blobs[0].put_file(str(src))
            peer0 = rts[0].swarm.peer_id
            # What the NAT service sets on a PRIVATE node; its heartbeats carry it to node 1.
            rts[0].swarm.http_url = f"p2p://{peer0}"
            await wait_until(lambda: rts[1].swarm.peerbook.http_url(peer0) == f"p2p://{peer0}", timeout=30,
                             what="node 1 to hear node 0's p2p:// blob URL")
            fetcher = HintedFetcher(blobs[1], rts[1].swarm)
            try:
                got = await fetcher.fetch(cid, holders=[peer0], max_size=1 << 20, timeout=60)
            finally:
                fetcher.close()
            assert got == src.read_bytes()
            assert rts[0].status()["nat"]["chunk_stream"]["served_bytes"] >= len(got)

    run(main(), timeout=120)


def test_a_run_lookup_fetches_from_an_organiser_that_advertises_p2p(tmp_path: Path) -> None:
    """``join --run``'s lookup (``roles.runs.client_swarm``) fetches a run's manifest and model files
    from a node that advertises ``p2p://`` (an organiser behind NAT): the lookup runs the NAT service's
    client side, so the libp2p chunk stream is one of its sources. Before, it had HTTP alone and found
    "no provider"."""
    from intellect_node.blobs.service import BlobService
    from intellect_node.commands.run import seal_run
    from intellect_node.config.loader import build_config
    from intellect_node.config.run_manifest import run_sections
    from intellect_node.p2p.identity import init_key
    from intellect_node.p2p.nat.service import NatService
    from intellect_node.roles.runs import client_swarm, fetch_model, fetch_run
    from tests.support.swarm import run, runtime_nodes
    from tests.support.wait import wait_until

    organiser_dir = tmp_path / "nodes" / "node0"  # runtime_nodes' first data dir: the node serves it
    key = init_key(organiser_dir)
    model = tmp_path / "model"
    model.mkdir()
    files = {"config.json": b'{"tiny": true}', "weights.bin": os.urandom(200_000)}
    for name, data in files.items():
        (model / name).write_bytes(data)
    shared = run_sections(build_config({"run": {"run_id": "behind-nat", "trainer_peer_id": key.peer_id}}))
    cid = seal_run(key, organiser_dir, "behind-nat", model, sorted(model.iterdir()), shared, "{}", [],
                   lambda _line: None)
    holder: dict[int, Any] = {}

    def nat_factory(rt: Any) -> Any:
        holder[id(rt)] = svc = NatService.for_runtime(rt)
        return svc

    def blob_factory(rt: Any) -> Any:
        nat = holder[id(rt)]
        svc = BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board, extra_sources=[nat.source])
        nat.attach_blob_store(lambda: svc.store)
        return svc

    async def main() -> None:
        async with runtime_nodes(tmp_path / "nodes", 1, services=[nat_factory, blob_factory]) as rts:
            organiser = rts[0]
            assert organiser.swarm.peer_id == key.peer_id
            organiser.swarm.http_url = f"p2p://{key.peer_id}"  # what a PRIVATE node advertises
            boot = f"{organiser.swarm.listen_addrs()[0]}"
            async with client_swarm([boot], data_dir=tmp_path / "joiner") as (_swarm, blobs):
                await wait_until(lambda: organiser.status()["blobs"]["blobs"], timeout=30,
                                 what="the organiser's blob service up")
                manifest, _raw = await fetch_run(blobs, cid, organiser=key.peer_id)
                out = await fetch_model(blobs, manifest, tmp_path / "joiner" / "model")
            assert {p.name: p.read_bytes() for p in out.iterdir()} == files
            served = organiser.status()["nat"]["chunk_stream"]["served_bytes"]
            assert served >= sum(map(len, files.values())), served

    run(main(), timeout=120)


def _static(providers: list[Any]) -> Any:
    async def find(cid: str) -> list[Any]:
        return providers

    return find


def test_yamux_credits_the_window_per_half_window_not_per_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # py-libp2p 0.8.1 sent a WINDOW_UPDATE after every read, even each 1-byte read of a varint prefix
    # (3 frames per small message); under load that flood stalled a relay's busy connections (docs/nat.md).
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.stream_muxer.yamux import yamux
    from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited
    from multiaddr import Multiaddr

    from intellect_node.p2p.compat import apply_fixes

    apply_fixes()
    frames: dict[int, int] = {}
    write_frame = yamux.Yamux._write_frame

    async def counting(self: Any, data: bytes) -> None:  # observes, then sends for real
        frames[data[1]] = frames.get(data[1], 0) + 1
        await write_frame(self, data)

    monkeypatch.setattr(yamux.Yamux, "_write_frame", counting)
    n_small, bulk = 500, os.urandom(3 * 1024 * 1024)
    got: list[bytes] = []

    async def main() -> None:
        a, b = _host(3), _host(4)
        listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
        done = trio.Event()

        async def handler(stream: Any) -> None:
            for _ in range(n_small):
                got.append(await read_varint_prefixed_bytes_limited(stream, 1 << 20))
            buf = bytearray()
            while len(buf) < len(bulk):  # more than the 256 KiB window: credits must keep coming
                buf += await stream.read(1 << 16)
            got.append(bytes(buf))
            done.set()

        async with a.run(listen), b.run(listen):
            a.set_stream_handler("/intellect-test/window/1.0.0", handler)
            await b.connect(info_from_p2p_addr(a.get_addrs()[0]))
            s = await b.new_stream(a.get_id(), ["/intellect-test/window/1.0.0"])
            before = frames.get(yamux.TYPE_WINDOW_UPDATE, 0)
            for i in range(n_small):
                await s.write(encode_varint_prefixed(b"m%03d" % i + b"x" * 200))
            with trio.fail_after(60):
                while len(got) < n_small:
                    await trio.sleep(0.01)
            small_updates = frames.get(yamux.TYPE_WINDOW_UPDATE, 0) - before
            await s.write(bulk)
            with trio.fail_after(60):
                await done.wait()
            assert small_updates <= 2, small_updates  # ~100 KiB read: at most one credit, not 1500

    trio.run(main)
    assert [m[:4] for m in got[:n_small]] == [b"m%03d" % i for i in range(n_small)]
    assert got[-1] == bulk


def test_advertised_addresses_are_kept_briefly_and_follow_circuits_and_listeners_at_once() -> None:
    """py-libp2p asks for the host's addresses for every pubsub RPC's peer record: the wrapper answers
    from a short cache, but a new circuit, a change of view or a new listener shows at once."""
    from multiaddr import Multiaddr

    from intellect_node.p2p.nat import relay

    class Net:
        listeners: dict[str, object] = {}

    class Host:
        calls = 0

        def get_network(self) -> Net:
            return net

        def get_addrs(self) -> list[Multiaddr]:
            Host.calls += 1
            return [Multiaddr(f"/ip4/127.0.0.1/tcp/{4000 + len(net.listeners)}")]

    net, host = Net(), Host()
    circuits: list[str] = []
    private = [False]
    relay.advertise_circuit_addrs(host, lambda: list(circuits),  # type: ignore[arg-type]  # the fake above
                                  private=lambda: private[0])
    assert [str(a) for a in host.get_addrs()] == ["/ip4/127.0.0.1/tcp/4000"]
    for _ in range(50):
        host.get_addrs()
    assert Host.calls == 1  # answered from the cache
    net.listeners["tcp"] = object()  # listening now
    assert [str(a) for a in host.get_addrs()] == ["/ip4/127.0.0.1/tcp/4001"]
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    relay_id = ID.from_pubkey(create_new_key_pair(b"\x01" * 32).public_key)
    circ = f"/ip4/10.0.0.1/tcp/1/p2p/{relay_id}/p2p-circuit"
    circuits.append(circ)
    assert [str(a) for a in host.get_addrs()][-1] == circ
    private[0] = True
    assert [str(a) for a in host.get_addrs()] == [circ]
    assert Host.calls == 3
