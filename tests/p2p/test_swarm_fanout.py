"""Two subscribers of one topic on one node (two roles of it: a worker and an auditing validator both
hear step records) each get every message once; libp2p keeps one validator per topic, so the second
subscriber shares the first's decoding (``Swarm.subscribe``)."""

from __future__ import annotations

from collections import defaultdict

from tests.p2p.test_swarm_gossip import TOPIC, seal, validate_note
from tests.support.swarm import run, star, swarm_nodes
from tests.support.wait import wait_until


def test_a_second_subscriber_of_a_topic_gets_every_message_too() -> None:
    async def main() -> None:
        async with swarm_nodes(2, star(2)) as (a, b):
            got: dict[str, list[str]] = defaultdict(list)
            b.subscribe(TOPIC, validate_note, lambda m, o: got["first"].append(m.text))
            b.subscribe(TOPIC, validate_note, lambda m, o: got["second"].append(m.text))
            a.subscribe(TOPIC, validate_note, lambda m, o: got["own"].append(m.text), include_own=True)
            await wait_until(lambda: a.mesh_peers(TOPIC) and b.mesh_peers(TOPIC), 45, what="meshes")
            for k in range(3):
                await a.publish(TOPIC, seal(a.key, f"n{k}"))
            await wait_until(lambda: len(got["first"]) == len(got["second"]) == 3, 30,
                             what="both subscribers")
            assert got["first"] == got["second"] == ["n0", "n1", "n2"]
            assert b.delivered[TOPIC] == 6  # one delivery per subscriber and message
            assert got["own"] == ["n0", "n1", "n2"]  # include_own still holds for the publisher's own

    run(main(), 120)
