"""The relay client's DHT search for relays backs off while it finds none (issue #17: idle cost).

A node whose AutoNAT has no verdict (every node of a local swarm) or that is private holds relay
reservations; in a swarm without relays its client used to walk the DHT for them every check (5 s), on
every node, for ever: the largest single idle cost measured at 16 nodes (bench/README.md, scale). These
run the real client on a real libp2p host on trio's mock clock; the DHT is a stand-in that records when
it is asked and answers what the case needs (the network's answers are not what is under test)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import trio
import trio.testing

from intellect_node.p2p.nat import relay


def _host(i: int) -> Any:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    kp = create_new_key_pair(hashlib.sha256(f"relay-search-{i}-{os.getpid()}".encode()).digest())
    return new_host(key_pair=kp, sec_opt={PROTOCOL_ID: Transport(kp, x25519().private_key)})


class _Dht:
    """Answers a relay search with ``answer()``; records the trio time of each search."""

    def __init__(self, answer: Any = list) -> None:
        self.at: list[float] = []
        self.answer = answer

    async def provide(self, key: str, /) -> bool:
        raise AssertionError("a relay client never provides")

    async def find_providers(self, key: str, count: int = 20, /) -> list[Any]:
        assert key == relay.RELAY_DHT_KEY
        self.at.append(trio.current_time())
        found: list[Any] = self.answer()
        return found


def _run(client: relay.RelayClient, seconds: float, then: Any = None) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await trio.sleep(seconds)
            if then is not None:
                await then(client)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_searches_for_relays_back_off_while_none_is_found() -> None:
    """An hour without any relay: the first search at once, then waits doubling from 10 s to the
    5-minute cap (16 searches; searching at every 5 s check made 721)."""
    dht = _Dht()
    client = relay.RelayClient(_host(1), dht, check_interval_s=5.0)
    _run(client, 3600)
    gaps = [round(b - a, 3) for a, b in zip(dht.at, dht.at[1:])]
    assert gaps[:6] == [10, 20, 40, 80, 160, 300], gaps
    assert set(gaps[6:]) == {300}, gaps
    assert len(dht.at) == client.searches == 16


def test_a_lost_reservation_searches_at_once_and_a_found_relay_resets_the_wait() -> None:
    """After the waits grew, losing a held relay (its connection is gone) searches in the same check;
    a search that brings a relay to try (here one that cannot be reached) brings the wait back to the
    check interval, and it grows again while that relay is in its back-off."""
    from libp2p.peer.peerinfo import PeerInfo

    candidate = _host(3).get_id()
    answers: list[list[Any]] = []
    dht = _Dht(lambda: answers.pop(0) if answers else [])
    client = relay.RelayClient(_host(2), dht, check_interval_s=5.0)
    lost_at: list[float] = []

    async def lose_a_relay(c: relay.RelayClient) -> None:
        assert len(dht.at) == 6  # 0, 10, 30, 70, 150, 310: the next one would be at 610
        gone = _host(4).get_id().to_base58()
        c.held[gone] = relay.HeldReservation(relay=gone, relay_addrs=(), expires_at=1e12, obtained_at=0.0,
                                             data_limit=None, duration_limit=None)
        answers.append([PeerInfo(candidate, [])])  # the search after the loss finds a relay to try
        lost_at.append(trio.current_time())
        await trio.sleep(200)

    _run(client, 400, lose_a_relay)
    assert client.lost == 1
    after = [t for t in dht.at if t >= lost_at[0]]
    assert after[0] - lost_at[0] <= 5.0  # the next check, not the 610 s the back-off had reached
    gaps = [round(b - a, 3) for a, b in zip(after, after[1:])]
    assert gaps[:3] == [5, 10, 20], gaps  # reset by the relay it found, growing while it is backed off
