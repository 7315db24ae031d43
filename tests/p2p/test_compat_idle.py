"""Workarounds that cut what py-libp2p's pubsub does per RPC (issue #17, an idle node's CPU), each shown
on the stock library first:

- ``peer-record-per-rpc``: a peer's signed record, attached to every pubsub RPC, is checked once per
  change (compat's ``_consume_record_once``), with the stock check's verdict for every other case.
  Records are real (py-libp2p's ``seal_record`` with real ed25519 keys) and so is the receiving host's
  peerstore; signature checks are counted where the library makes them (``Envelope.validate``).
- ``task-per-duplicate``: a copy of a message already seen starts no ``push_msg`` task (real nodes; a
  peer sends the same signed message ten times on its real pubsub stream).
- ``rpc-split-per-send``: an outbound RPC that fits goes out as it is; a large one is split as before.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest

from intellect_node.p2p import compat as compat
from tests.support.swarm import run, swarm_nodes
from tests.support.wait import wait_until

TOPIC = "/intellect/test-records/1"


def _keys(i: int) -> Any:
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair(hashlib.sha256(f"records-{i}-{os.getpid()}".encode()).digest())


def _host(i: int) -> Any:
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    kp = _keys(i)
    return new_host(key_pair=kp, sec_opt={PROTOCOL_ID: Transport(kp, x25519().private_key)})


def _rpc(signer: Any, peer: Any, addrs: list[str], seq: int, *, forge: bool = False) -> Any:
    """A pubsub RPC (a subscription) carrying ``peer``'s record, signed by ``signer``."""
    from libp2p.peer.envelope import seal_record
    from libp2p.peer.peer_record import PeerRecord
    from libp2p.pubsub.pb import rpc_pb2
    from multiaddr import Multiaddr

    env = seal_record(PeerRecord(peer, [Multiaddr(a) for a in addrs], seq), signer.private_key)
    if forge:
        env.signature = bytes([env.signature[0] ^ 1]) + env.signature[1:]
    rpc = rpc_pb2.RPC(subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True, topicid=TOPIC)])
    rpc.senderRecord = env.marshal_envelope()
    return rpc


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every signature check of a signed envelope made meanwhile (the bytes it checked)."""
    from libp2p.peer.envelope import Envelope

    compat.apply_fixes()
    seen: list[bytes] = []
    stock = Envelope.validate

    def validate(self: Envelope, domain: str) -> None:
        seen.append(bytes(self.signature))
        stock(self, domain)

    monkeypatch.setattr(Envelope, "validate", validate)
    return seen


def _consume() -> Any:
    """The function pubsub's read loop calls for each RPC (as patched by apply_fixes)."""
    from libp2p.pubsub import gossipsub, pubsub

    assert gossipsub.maybe_consume_signed_record is pubsub.maybe_consume_signed_record
    return pubsub.maybe_consume_signed_record


def test_stock_pubsub_checks_the_same_peer_record_on_every_rpc(checks: list[bytes]) -> None:
    """The defect: 20 RPCs with the same record, 20 signature checks. With the fix: one, the same
    verdict, and the sender's addresses in the peerstore."""
    from multiaddr import Multiaddr

    receiver, sender = _host(1), _keys(2)
    from libp2p.peer.id import ID

    sid = ID.from_pubkey(sender.public_key)
    rpc = _rpc(sender, sid, ["/ip4/10.0.0.2/tcp/4001"], seq=5)
    stock = compat.stock("pubsub.maybe_consume_signed_record")
    assert all(stock(rpc, receiver, sid) for _ in range(20))
    assert len(checks) == 20
    checks.clear()
    assert all(_consume()(rpc, receiver, sid) for _ in range(20))
    assert len(checks) == 1
    assert Multiaddr("/ip4/10.0.0.2/tcp/4001") in receiver.get_peerstore().addrs(sid)


def test_changed_forged_foreign_and_superseded_records_get_the_stock_verdict(checks: list[bytes]) -> None:
    """A new record (higher sequence, new address) is checked and stored; a forged one is refused on
    every RPC and never remembered; another peer's record is refused; and once a newer record for the
    peer arrived another way, its old record is checked again and refused, as the stock check does."""
    from libp2p.peer.envelope import seal_record
    from libp2p.peer.id import ID
    from libp2p.peer.peer_record import PeerRecord
    from multiaddr import Multiaddr

    consume = _consume()
    receiver, sender, other = _host(3), _keys(4), _keys(5)
    sid, oid = ID.from_pubkey(sender.public_key), ID.from_pubkey(other.public_key)
    store = receiver.get_peerstore()

    first = _rpc(sender, sid, ["/ip4/10.0.0.4/tcp/4001"], seq=10)
    assert consume(first, receiver, sid) and consume(first, receiver, sid)
    assert len(checks) == 1
    moved = _rpc(sender, sid, ["/ip4/10.0.0.44/tcp/4001"], seq=11)
    assert consume(moved, receiver, sid) and consume(moved, receiver, sid)
    assert len(checks) == 2
    assert store.addrs(sid) == [Multiaddr("/ip4/10.0.0.44/tcp/4001")]

    forged = _rpc(sender, sid, ["/ip4/6.6.6.6/tcp/4001"], seq=12, forge=True)
    assert not any(consume(forged, receiver, sid) for _ in range(3))
    assert len(checks) == 5  # each forged RPC checked, none accepted
    assert store.addrs(sid) == [Multiaddr("/ip4/10.0.0.44/tcp/4001")]

    foreign = _rpc(other, oid, ["/ip4/10.0.0.5/tcp/4001"], seq=1)  # valid, but not the sender's
    assert not consume(foreign, receiver, sid) and not consume(foreign, receiver, sid)

    stock = compat.stock("pubsub.maybe_consume_signed_record")
    assert consume(moved, receiver, sid)  # remembered again after the forgery
    newer = seal_record(PeerRecord(sid, [Multiaddr("/ip4/10.0.0.45/tcp/4001")], 13), sender.private_key)
    assert store.consume_peer_record(newer, 7200)  # e.g. from a DHT answer
    before = len(checks)
    assert consume(moved, receiver, sid) is stock(moved, receiver, sid) is False
    assert len(checks) == before + 2  # checked again (ours, then the stock call), not taken as known


def test_gossip_between_real_nodes_checks_each_peer_record_a_few_times_not_per_rpc(
        checks: list[bytes]) -> None:
    """Two real nodes: 40 messages and their gossip control RPCs, a handful of record checks (at
    connect and when a record changes), not one or two per RPC."""
    async def main() -> None:
        async with swarm_nodes(2, {0: [1]}) as nodes:
            got: list[bytes] = []
            for n in nodes:
                n.subscribe(TOPIC, lambda data, origin: data, lambda msg, origin: got.append(msg))
            await wait_until(lambda: all(n.mesh_peers(TOPIC) for n in nodes), 20, what="meshes")
            before = len(checks)
            for i in range(40):
                await nodes[i % 2].publish(TOPIC, b"m%d" % i)
            await wait_until(lambda: len(got) >= 40, 30, what="40 messages")
            assert len(checks) - before <= 8, len(checks) - before

    run(main(), 90)


def _duplicates_scenario(filter_fn: Any) -> tuple[int, int]:
    """Node 1 publishes one message to node 0, then writes the same signed message nine more times on its
    pubsub stream to node 0, then one new message. Node 0's read loop uses ``filter_fn`` as its filter.
    Returns (push_msg tasks node 0 started for node 1's messages, messages node 0 delivered)."""
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.pubsub.pubsub import Pubsub

    async def main() -> tuple[int, int]:
        async with swarm_nodes(2, {0: [1]}) as nodes:
            got: list[bytes] = []
            for n in nodes:
                n.subscribe(TOPIC, lambda data, origin: data, lambda msg, origin: got.append(msg))
            await wait_until(lambda: all(n.mesh_peers(TOPIC) for n in nodes), 20, what="meshes")
            receiver, sender = nodes[0].p2p, nodes[1].p2p
            tasks: list[str] = []
            manager = receiver.pubsub.manager
            stock_run_task = manager.run_task

            def run_task(fn: Any, *args: Any, **kwargs: Any) -> Any:
                if getattr(fn, "__name__", "") == "push_msg":
                    tasks.append(args[0].to_base58())
                return stock_run_task(fn, *args, **kwargs)

            manager.run_task = run_task
            sent: list[Any] = []
            stock_publish = sender.gossipsub.publish

            async def keep(forwarder: Any, msg: Any) -> None:
                sent.append(msg)
                await stock_publish(forwarder, msg)

            sender.gossipsub.publish = keep
            await nodes[1].publish(TOPIC, b"once")
            await wait_until(lambda: b"once" in got and sent, 15, what="the first message")

            async def resend() -> None:
                stream = sender.pubsub.peers[receiver.host.get_id()]
                for _ in range(9):
                    await sender.pubsub.write_msg(stream, rpc_pb2.RPC(publish=[sent[0]]))

            await nodes[1].bridge.call(resend)
            await nodes[1].publish(TOPIC, b"after")  # RPCs on a stream arrive in order: the copies came first
            await wait_until(lambda: b"after" in got, 15, what="the message after the copies")
            return sum(t == nodes[1].peer_id for t in tasks), got.count(b"once")

    stock = Pubsub._is_subscribed_to_msg
    Pubsub._is_subscribed_to_msg = filter_fn  # type: ignore[method-assign]  # patched for this test
    try:
        return run(main(), 60)
    finally:
        Pubsub._is_subscribed_to_msg = stock  # type: ignore[method-assign]  # restored / wrapped as above


def test_stock_pubsub_starts_a_task_for_every_copy_of_a_message() -> None:
    """The defect: ten copies, ten tasks (plus one for the message after them); delivered once."""
    compat.apply_fixes()
    assert _duplicates_scenario(compat.stock("Pubsub._is_subscribed_to_msg")) == (11, 1)


def test_copies_of_a_seen_message_start_no_task() -> None:
    """With the fix: one task for the first copy, one for the next message; delivered once."""
    from libp2p.pubsub.pubsub import Pubsub

    compat.apply_fixes()
    assert _duplicates_scenario(Pubsub._is_subscribed_to_msg) == (2, 1)


def _rpcs() -> tuple[Any, Any]:
    """A heartbeat-sized forward with control piggybacked, and an RPC of 40 messages of 40 KiB."""
    from libp2p.pubsub.pb import rpc_pb2

    def msg(i: int, size: int) -> Any:
        return rpc_pb2.Message(from_id=b"p" * 38, data=bytes([i % 256]) * size, seqno=i.to_bytes(8, "big"),
                               topicIDs=[TOPIC])

    small = rpc_pb2.RPC(publish=[msg(1, 300)])
    small.control.ihave.extend([rpc_pb2.ControlIHave(topicID=TOPIC, messageIDs=[b"id1", b"id2"])])
    small.senderRecord = b"r" * 200
    large = rpc_pb2.RPC(publish=[msg(i, 40 * 1024) for i in range(40)])
    large.senderRecord = b"r" * 200
    return small, large


def test_stock_rpc_queue_rebuilds_rpcs_that_fit() -> None:
    """The defect: a 600-byte RPC comes out of the stock splitter as two new RPCs (its message copied
    into one, its control into another)."""
    compat.apply_fixes()
    small, _ = _rpcs()
    parts = compat.stock("pubsub.RpcQueue")().split_rpc(small)
    assert len(parts) == 2 and all(p is not small for p in parts)


def test_an_rpc_that_fits_goes_out_whole_and_a_large_one_is_split_as_before() -> None:
    from libp2p.pubsub import pubsub

    compat.apply_fixes()
    small, large = _rpcs()
    queue = pubsub.RpcQueue()  # what pubsub builds for each peer
    assert queue.split_rpc(small) == [small] and queue.split_rpc(small)[0] is small
    ours, stock = queue.split_rpc(large), compat.stock("pubsub.RpcQueue")().split_rpc(large)
    assert [p.SerializeToString() for p in ours] == [p.SerializeToString() for p in stock]
    assert len(ours) > 1 and all(p.ByteSize() <= queue.max_message_size for p in ours)
    from libp2p.pubsub.pb import rpc_pb2

    assert queue.split_rpc(rpc_pb2.RPC(senderRecord=b"r" * 10)) == \
        compat.stock("pubsub.RpcQueue")().split_rpc(rpc_pb2.RPC(senderRecord=b"r" * 10))
