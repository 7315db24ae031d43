"""Low items of the peerbook: fresh keys must not wipe rejection counts, fill memory with bans,
or fill the list of peers a restarted node dials."""

from __future__ import annotations

from pathlib import Path

from intellect_node.p2p import peerbook as pb
from intellect_node.p2p.peerbook import MAX_BANNED, MAX_PEERS, PeerBook


def test_evicting_idle_records_keeps_rejection_counts() -> None:
    book = PeerBook("me", auto_ban_after=100)
    for _ in range(60):
        book.record_rejection("mallory", "bad")
    for i in range(MAX_PEERS + 10):  # a flood of fresh keys pushes records out
        book.heard(f"sybil{i}")
    for _ in range(40):
        book.record_rejection("mallory", "bad")
    assert book.is_banned("mallory")  # 60 + 40: the count survived eviction


def test_banned_records_are_bounded() -> None:
    book = PeerBook("me")
    for i in range(MAX_BANNED + 50):
        book.ban(f"banned{i}", "test")
    assert len(book.bans()) == MAX_BANNED
    assert book.is_banned(f"banned{MAX_BANNED + 49}") and not book.is_banned("banned0")  # oldest go first
    for i in range(MAX_PEERS + 10):
        book.heard(f"other{i}")
    assert len(book._peers) <= MAX_PEERS


def test_only_peers_we_had_a_connection_with_are_remembered(tmp_path: Path) -> None:
    book = PeerBook("me", tmp_path)
    book.remember("sybil", ["/ip4/127.0.0.1/tcp/5/p2p/sybil"], if_connected=True)  # a gossiped heartbeat
    book.set_connected("friend", True, remote_ip="127.0.0.1")
    book.set_connected("friend", False)
    book.remember("friend", ["/ip4/127.0.0.1/tcp/6/p2p/friend"], if_connected=True)
    assert [p for p, _ in book.remembered()] == ["friend"]
    assert book.addresses("friend") == (["127.0.0.1"], [])
    assert pb.MAX_CONN_IPS >= 1
