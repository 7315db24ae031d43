"""Gossipsub for large swarms (p2p/gossip_params.py): peer scoring on, the adaptive mode off.

Two py-libp2p 0.8.1 defects are shown on the stock router (compat's ``adaptive-gossip`` and
``score-mesh-prune``) next to our settings; then on real hosts on 127.0.0.1: a peer that forwards
invalid messages loses score, is pruned from the mesh and falls below the publish and graylist
thresholds (its messages are dropped unread) before the peerbook's automatic ban, while honest gossip
keeps flowing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12, GossipSub

from intellect_node.errors import ProtocolError
from intellect_node.p2p import compat, gossip_params
from intellect_node.p2p.peerbook import AUTO_BAN_AFTER
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import topic
from tests.support.swarm import run, swarm_nodes
from tests.support.wait import wait_until

TOPIC = topic("test", "policy")
SENT = 40
"""Invalid messages mallory sends: at -10 each (+1 for its one good message) it passes the publish and
graylist threshold (-200) after about 21, well before the peerbook bans it (100)."""


def _peers(n: int) -> list[ID]:
    return [ID.from_base58(SigningKey.generate().peer_id) for _ in range(n)]


def _router(**kw: Any) -> GossipSub:
    return GossipSub(protocols=[PROTOCOL_ID_V12], degree=gossip_params.D, degree_low=gossip_params.D_LOW,
                     degree_high=gossip_params.D_HIGH, heartbeat_interval=1, **kw)


def test_stock_adaptive_gossip_slows_the_heartbeat_of_a_healthy_mesh() -> None:
    """A mesh at its target degree of honest peers: the stock adaptive mode, at its 30 s health check,
    moves the 1 s heartbeat to 60 s; ours (adaptive off) keeps 1 s and the configured degrees."""
    for adaptive, heartbeat in ((True, 60), (False, 1)):
        router = _router(adaptive_gossip_enabled=adaptive, score_params=gossip_params.score_params())
        router.mesh[TOPIC] = set(_peers(gossip_params.D))
        router.last_health_update = 0  # the 30 s since start have passed
        router._update_network_health()
        router._adapt_gossip_parameters()
        assert router.heartbeat_interval == heartbeat, (adaptive, router.network_health_score)
    assert (router.adaptive_degree_low, router.adaptive_degree_high) == (gossip_params.D_LOW,
                                                                        gossip_params.D_HIGH)


def _with_subscribers(router: GossipSub, peers: list[ID]) -> None:
    router.pubsub = SimpleNamespace(peer_topics={TOPIC: set(peers)})  # type: ignore[assignment]  # a stand-in pubsub
    for p in peers:
        router.peer_protocol[p] = PROTOCOL_ID_V12


def test_stock_mesh_heartbeat_keeps_a_negative_score_peer() -> None:
    honest, (bad,) = _peers(4), _peers(1)
    for wrapped in (False, True):
        router = _router(score_params=gossip_params.score_params(), adaptive_gossip_enabled=False)
        pruned: list[tuple[ID, str]] = []
        if wrapped:
            compat.prune_low_scores(router, gossip_params.MESH_THRESHOLD,
                                    lambda p, t, _s: pruned.append((p, t)))
        _with_subscribers(router, [*honest, bad])
        router.mesh[TOPIC] = {*honest, bad}
        assert router.scorer is not None
        for _ in range(50):
            router.scorer.on_invalid_message(bad, TOPIC)
        assert router.scorer.score(bad, [TOPIC]) == -500
        _graft, prune = router.mesh_heartbeat()
        if not wrapped:
            assert bad in router.mesh[TOPIC] and bad not in prune  # the defect
            continue
        assert bad not in router.mesh[TOPIC] and prune[bad] == [TOPIC] and pruned == [(bad, TOPIC)]
        assert router._check_back_off(bad, TOPIC)  # and it may not GRAFT back at once
        # Below D_low with the low scorer as a candidate: it is not grafted again.
        router.mesh[TOPIC] = set(honest[:1])
        graft, _prune = router.mesh_heartbeat()
        assert bad not in router.mesh[TOPIC] and bad not in graft and set(honest) <= router.mesh[TOPIC]


def test_stock_router_answers_a_graylisted_peers_iwant() -> None:
    """A peer below the graylist threshold sends an RPC with IHAVE and IWANT: the stock router handles
    both (the defect: the spec ignores every RPC of a graylisted peer); ours ignores its control part and
    counts it, and still handles the same RPC from an honest peer (``graylist-control``)."""
    import trio
    from libp2p.pubsub.pb import rpc_pb2

    compat.apply_fixes()
    honest, bad = _peers(2)
    rpc = rpc_pb2.RPC(control=rpc_pb2.ControlMessage(
        ihave=[rpc_pb2.ControlIHave(topicID=TOPIC, messageIDs=[b"00"])],
        iwant=[rpc_pb2.ControlIWant(messageIDs=[b"00"])]))
    for patched in (False, True):
        router = _router(score_params=gossip_params.score_params(), adaptive_gossip_enabled=False)
        _with_subscribers(router, [honest, bad])
        # the stand-in pubsub's topics (what we subscribe); Pubsub's own is a read-only property
        router.pubsub.topic_ids = {TOPIC: None}.keys()  # type: ignore[union-attr, misc]  # see above
        handled: list[tuple[str, ID]] = []

        def recorder(kind: str) -> Any:
            async def handle(_msg: Any, sender: ID) -> None:
                handled.append((kind, sender))
            return handle

        router.handle_ihave = recorder("ihave")  # type: ignore[method-assign]  # patched for this test
        router.handle_iwant = recorder("iwant")  # type: ignore[method-assign]  # patched for this test
        assert router.scorer is not None
        for _ in range(SENT):
            router.scorer.on_invalid_message(bad, TOPIC)
        assert router.scorer.is_graylisted(bad, [TOPIC]) and not router.scorer.is_graylisted(honest, [TOPIC])
        handle_rpc = GossipSub.handle_rpc if patched else compat.stock("GossipSub.handle_rpc")
        trio.run(handle_rpc, router, rpc, bad)
        trio.run(handle_rpc, router, rpc, honest)
        if not patched:
            assert handled == [("ihave", bad), ("iwant", bad), ("ihave", honest), ("iwant", honest)]
            continue
        assert handled == [("ihave", honest), ("iwant", honest)]
        assert compat.GRAYLIST_IGNORED[router] == 1


def _validate(data: bytes, origin: str) -> bytes:
    if not data.startswith(b"ok:"):
        raise ProtocolError(f"not a note: {data[:20]!r}")
    return data


def test_a_peer_forwarding_invalid_messages_is_pruned_and_gated_while_honest_gossip_flows() -> None:
    async def main() -> None:
        # mallory(0) - a(1), a - b(2), a - c(3), b - c: mallory reaches the rest only through a.
        async with swarm_nodes(4, {0: [1], 1: [2, 3], 2: [3]}) as nodes:
            mallory, a, b, c = nodes
            got: dict[str, list[bytes]] = {n.peer_id: [] for n in nodes}
            mallory.subscribe(TOPIC, lambda data, origin: data, got[mallory.peer_id].append)
            for n in (a, b, c):
                n.subscribe(TOPIC, _validate, lambda msg, origin, me=n.peer_id: got[me].append(msg))
            await wait_until(lambda: mallory.peer_id in a.mesh_peers(TOPIC)
                             and a.peer_id in mallory.mesh_peers(TOPIC)
                             and b.mesh_peers(TOPIC) and c.mesh_peers(TOPIC), 20, what="meshes")
            await mallory.publish(TOPIC, b"ok:hello")  # honest at first
            await wait_until(lambda: b"ok:hello" in got[b.peer_id] and b"ok:hello" in got[c.peer_id], 15,
                             what="mallory's good message everywhere")

            # An honest peer leaves a's mesh when pruned and stops sending; mallory ignores the PRUNE
            # and keeps a in its mesh, so it goes on pushing into a.
            async def ignore_prune(prune_msg: Any, sender: ID) -> None:
                return None

            mallory.p2p.gossipsub.handle_prune = ignore_prune
            for i in range(8):
                await mallory.publish(TOPIC, b"bad:%d" % i)
            await wait_until(lambda: mallory.peer_id not in a.mesh_peers(TOPIC) and any(
                "pruned from the mesh" in r for r in a.peerbook.rejections(mallory.peer_id)[1]), 20,
                what="a prunes mallory from its mesh and says why")
            for i in range(8, SENT):
                await mallory.publish(TOPIC, b"bad:%d" % i)
            await wait_until(lambda: a.p2p.peer_score(mallory.peer_id, TOPIC)
                             < gossip_params.GRAYLIST_THRESHOLD, 20, what="its score below the graylist")
            scorer, mid = a.p2p.gossipsub.scorer, ID.from_base58(mallory.peer_id)
            assert not scorer.allow_publish(mid, [TOPIC]) and scorer.is_graylisted(mid, [TOPIC])
            count, _reasons = a.peerbook.rejections(mallory.peer_id)
            assert count < AUTO_BAN_AFTER and not a.peerbook.is_banned(mallory.peer_id)  # scoring came first
            assert a.dropped[TOPIC] < SENT  # past the publish threshold its messages were not even validated
            assert mallory.peer_id not in a.mesh_peers(TOPIC)

            # Honest gossip flows, through a too, and nothing of mallory's went past a.
            await c.publish(TOPIC, b"ok:from c")
            await b.publish(TOPIC, b"ok:from b")
            await wait_until(lambda: b"ok:from c" in got[a.peer_id] and b"ok:from c" in got[b.peer_id]
                             and b"ok:from b" in got[a.peer_id] and b"ok:from b" in got[c.peer_id], 15,
                             what="honest gossip after the pruning")
            assert b.dropped[TOPIC] == 0 and c.dropped[TOPIC] == 0
            assert b.p2p.peer_score(a.peer_id, TOPIC) >= 0  # a forwarded only what was valid

    run(main(), 90)


def test_idontwant_goes_out_for_large_messages_only() -> None:
    """``idontwant-threshold``: a heartbeat-sized message gets no IDONTWANT, a 2 KiB one does. Every
    IDONTWANT the three nodes receive names one message ID, the large message's: RPCs on a connection
    arrive in order, so one for the small message (published first) would have come before."""
    async def main() -> None:
        async with swarm_nodes(3, {0: [1], 1: [2]}) as nodes:
            got: dict[str, list[bytes]] = {n.peer_id: [] for n in nodes}
            ids: list[bytes] = []
            for n in nodes:
                n.subscribe(TOPIC, _validate, lambda msg, origin, me=n.peer_id: got[me].append(msg))
                stock = n.p2p.gossipsub.handle_idontwant

                async def record(msg: Any, sender: ID, stock: Any = stock) -> None:
                    ids.extend(bytes(m) for m in msg.messageIDs)
                    await stock(msg, sender)

                n.p2p.gossipsub.handle_idontwant = record
            await wait_until(lambda: all(n.mesh_peers(TOPIC) for n in nodes)
                             and len(nodes[1].mesh_peers(TOPIC)) == 2, 20, what="meshes")
            small, large = b"ok:" + b"s" * 200, b"ok:" + b"L" * 2048
            await nodes[0].publish(TOPIC, small)
            others = [got[n.peer_id] for n in nodes[1:]]  # the publisher does not hear its own
            await wait_until(lambda: all(small in g for g in others), 15, what="the small message")
            await nodes[0].publish(TOPIC, large)
            await wait_until(lambda: all(large in g for g in others) and len(ids) >= 2, 15,
                             what="the large message and its IDONTWANTs")
            assert len(set(ids)) == 1, ids

    run(main(), 60)
