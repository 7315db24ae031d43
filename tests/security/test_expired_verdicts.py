"""An expired verdict is not forwarded by gossip, and no one is blamed.

Before, the gossip validator let an expired verdict through (refusing it there would have blamed the
honest validator that signed it, and charged an invalid message to the peer that forwarded it), so
replays travelled the whole mesh and only the trainer ignored them. Now the validator *ignores* it
(``MessageIgnored``; compat ``gossip-ignore``): not delivered, not forwarded, nothing recorded against
the signer in the peerbook and no invalid-message count (P4) against the forwarder. Real libp2p hosts
on 127.0.0.1: replayer - a - b, so b hears the replayer only through a.
"""

from __future__ import annotations

from libp2p.peer.id import ID

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import (
    VERDICT_KIND,
    VERDICT_MAX_AGE_MS,
    BatchVerdict,
    now_ms,
    seal_verdict,
    verdict_validator,
)
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import topic
from tests.support.swarm import run, swarm_nodes
from tests.support.wait import wait_until

RUN = "expired-verdicts"
TOPIC = topic(RUN, VERDICT_KIND)
WORKER = SigningKey.generate().peer_id
OLD, FRESH, OTHER = (cid_of(name) for name in (b"old", b"fresh", b"other"))


def _verdict(cid: str, time_ms: int, run_id: str = RUN) -> BatchVerdict:
    return BatchVerdict(run_id=run_id, batch_cid=cid, worker=WORKER, policy_version=0, accepted=True,
                        n_accepted=2, n_rejected=0, time_ms=time_ms)


def test_an_expired_verdict_is_ignored_not_forwarded_and_blames_no_one() -> None:
    async def main() -> None:
        async with swarm_nodes(3, {0: [1], 1: [2]}) as nodes:
            replayer, a, b = nodes
            trusted = frozenset({replayer.peer_id})
            got: dict[str, list[str]] = {a.peer_id: [], b.peer_id: []}
            told: list[str] = []
            replayer.subscribe(TOPIC, lambda data, origin: data, lambda msg, origin: None)
            for n in (a, b):
                validate = verdict_validator(RUN, trusted, on_ignored=lambda v, s, why: told.append(why))
                n.subscribe(TOPIC, validate,
                            lambda msg, origin, me=n.peer_id: got[me].append(msg[0].batch_cid))
            await wait_until(lambda: replayer.peer_id in a.mesh_peers(TOPIC)
                             and b.peer_id in a.mesh_peers(TOPIC) and a.peer_id in b.mesh_peers(TOPIC), 20,
                             what="meshes")

            old = now_ms() - VERDICT_MAX_AGE_MS - 60_000  # sealed 6 minutes ago: a replay
            await replayer.publish(TOPIC, seal_verdict(replayer.key, _verdict(OLD, old)))
            await replayer.publish(TOPIC, seal_verdict(replayer.key, _verdict(FRESH, now_ms())))
            # Same publisher, same path, in order: once b has the fresh one, the old one would be there.
            await wait_until(lambda: FRESH in got[b.peer_id], 20, what="the fresh verdict at b")
            assert got == {a.peer_id: [FRESH], b.peer_id: [FRESH]}
            assert a.ignored[TOPIC] == 1 and a.dropped[TOPIC] == 0 and b.ignored[TOPIC] == 0
            assert len(told) == 1 and "ago" in told[0]
            assert a.peerbook.rejections(replayer.peer_id)[0] == 0  # the signer is not blamed
            scorer = a.p2p.gossipsub.scorer
            assert scorer.invalid_messages[ID.from_base58(replayer.peer_id)][TOPIC] == 0  # nor the forwarder

            # A verdict that is wrong (another run's) is still refused with blame, as before.
            await replayer.publish(TOPIC, seal_verdict(replayer.key, _verdict(OTHER, now_ms(), "other")))
            await wait_until(lambda: a.dropped[TOPIC] == 1, 20, what="a refuses the other run's verdict")
            assert a.peerbook.rejections(replayer.peer_id)[0] == 1
            assert scorer.invalid_messages[ID.from_base58(replayer.peer_id)][TOPIC] > 0

    run(main(), 90)
