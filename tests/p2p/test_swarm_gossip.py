"""Gossip and DHT between real libp2p hosts on 127.0.0.1 (in-process, one trio thread per node)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import Envelope, SigningKey, open_envelope
from intellect_node.protocol.topics import topic
from tests.support.swarm import line, run, star, swarm_nodes
from tests.support.wait import wait_until

DOMAIN = "intellect/test-note/1"
MAX_NOTE = 1024
TOPIC = topic("test", "policy")


class Note(codec.Message, frozen=True):
    run_id: str
    text: str


def validate_note(data: bytes, origin: str) -> Note:
    note, signer = open_envelope(data, DOMAIN, Note, max_size=MAX_NOTE)
    if note.run_id != "test":
        raise ProtocolError(f"note for run {note.run_id!r}")
    if signer != origin:
        raise ProtocolError("signer is not the publisher")
    return note


def seal(key: SigningKey, text: str, run_id: str = "test") -> bytes:
    return key.seal(DOMAIN, Note(run_id=run_id, text=text))


async def _subscribe_all(nodes: list[Any], got: dict[int, list[tuple[str, str]]]) -> None:
    for i, node in enumerate(nodes):
        def deliver(m: Note, o: str, i: int = i) -> None:
            got[i].append((o, m.text))

        node.subscribe(TOPIC, validate_note, deliver)


def test_gossip_reaches_every_subscriber_and_bursts_are_not_dropped() -> None:
    async def main() -> None:
        async with swarm_nodes(5, star(5)) as nodes:
            got: dict[int, list[tuple[str, str]]] = defaultdict(list)
            await _subscribe_all(nodes, got)
            await wait_until(lambda: all(len(n.topic_peers(TOPIC)) >= (4 if i == 0 else 1)
                                         for i, n in enumerate(nodes)), 45, what="subscriptions")
            await wait_until(lambda: len(nodes[0].mesh_peers(TOPIC)) == 4
                             and all(n.mesh_peers(TOPIC) for n in nodes), 45, what="meshes")
            # Every node bursts 8 messages at once: 40 messages cross the hub within ~1 s, four times
            # gossipsub's stock 10/s/topic; pacing plus our limit must deliver every one.
            await asyncio.gather(*(n.publish(TOPIC, seal(n.key, f"{i}:{k}"))
                                   for i, n in enumerate(nodes) for k in range(8)))
            expected = {i: {(n.peer_id, f"{j}:{k}") for j, n in enumerate(nodes) if j != i for k in range(8)}
                        for i in range(5)}
            try:
                await wait_until(lambda: all(set(got[i]) >= expected[i] for i in range(5)), 30,
                                 what="every message at every subscriber")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; got {[len(got[i]) for i in range(5)]} of 32 each") from None
            await asyncio.sleep(0.3)  # a duplicate delivery would show up now
            for i in range(5):
                assert len(got[i]) == len(expected[i]) == 32, (i, len(got[i]))
                assert nodes[i].dropped[TOPIC] == 0

    run(main(), 150)


def test_bad_gossip_is_dropped_blamed_and_not_forwarded() -> None:
    async def main() -> None:
        # mallory(0) - a(1) - b(2) - c(3): anything mallory sends reaches b only through a.
        async with swarm_nodes(4, line(4)) as nodes:
            mallory, a, b, c = nodes
            got: dict[int, list[tuple[str, str]]] = defaultdict(list)  # 0: a, 1: b, 2: c
            await _subscribe_all([a, b, c], got)
            await wait_until(lambda: a.peer_id in mallory.topic_peers(TOPIC) and b.mesh_peers(TOPIC)
                             and c.mesh_peers(TOPIC) and len(a.mesh_peers(TOPIC)) == 1
                             and len(b.mesh_peers(TOPIC)) == 2, 15, what="subscriptions and meshes")

            await mallory.publish(TOPIC, seal(mallory.key, "honest start"))
            await wait_until(lambda: "honest start" in [t for _o, t in got[2]], 10, what="a good message")

            good = codec.decode(seal(mallory.key, "tampered"), Envelope, max_size=4096)
            forged = codec.encode(Envelope(domain=good.domain, payload=good.payload, signer=good.signer,
                                           signature=bytes(64)))
            bad = {
                "garbage": b"\x93\x01\xff garbage",
                "bad signature": forged,
                "wrong run": seal(mallory.key, "other run", run_id="other"),
                "oversize": seal(mallory.key, "x" * (MAX_NOTE + 100)),
                "someone else's signature": seal(SigningKey.generate(), "not mine"),
            }
            for data in bad.values():
                await mallory.publish(TOPIC, data)
            await wait_until(lambda: a.dropped[TOPIC] == len(bad), 10, what="a drops every bad message")

            count, reasons = a.peerbook.rejections(mallory.peer_id)
            assert count == len(bad)
            joined = " | ".join(reasons)
            for word in ("cannot decode", "bad signature", "other", "exceeds", "signer is not"):
                assert word in joined, (word, joined)
            # The honest network keeps working, and nothing bad went past a.
            await c.publish(TOPIC, seal(c.key, "still alive"))
            await wait_until(lambda: all("still alive" in [t for _o, t in got[i]] for i in (0, 1)), 10,
                             what="a later good message")
            assert [t for _o, t in got[1]] == ["honest start", "still alive"]
            assert b.dropped[TOPIC] == 0 and c.dropped[TOPIC] == 0
            assert b.peerbook.rejections(mallory.peer_id)[0] == 0
            assert a.peer_id in b.connected_peers()

    run(main(), 60)


def test_providers_three_hops_away_resolve_to_http_urls_and_bans_hide_them() -> None:
    async def main() -> None:
        urls = [f"http://127.0.0.1:{20000 + i}" for i in range(6)]
        async with swarm_nodes(6, line(6), http_urls=urls) as nodes:
            cid = cid_of(b"a blob's manifest")
            await nodes[5].provide(cid)
            provs = await nodes[0].find_providers(cid)
            assert [(p.peer_id, p.http_url) for p in provs] == [(nodes[5].peer_id, urls[5])]

            # A provider that appears after the first lookup is still found (no stale local cache),
            # and each provider is listed once however many DHT nodes hold its record.
            await nodes[3].provide(cid)
            await nodes[5].provide(cid)
            provs = await nodes[0].find_providers(cid)
            assert sorted((p.peer_id, p.http_url) for p in provs) == sorted(
                [(nodes[5].peer_id, urls[5]), (nodes[3].peer_id, urls[3])])

            await nodes[0].ban(nodes[3].peer_id, "served bad chunks")
            assert nodes[0].is_banned(nodes[3].peer_id)
            provs = await nodes[0].find_providers(cid)
            assert [p.peer_id for p in provs] == [nodes[5].peer_id]
            assert await nodes[0].find_providers(cid_of(b"nobody has this")) == []

    run(main(), 90)
