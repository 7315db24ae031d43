"""Bans survive a restart (``peers.json``, ``p2p/peerbook.py``): a node restarted on its data dir still
refuses the peers it banned, for ``BAN_KEPT_S``; ``intellect-node peers bans`` lists them and ``peers
unban`` lifts one while the node is stopped."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

from intellect_node.p2p import peerbook
from intellect_node.p2p.peerbook import PeerBook
from tests.support.common import CLI
from tests.support.swarm import run
from tests.support.wait import wait_until


def test_bans_and_auto_bans_are_kept_for_a_week_and_can_be_lifted(tmp_path: Path) -> None:
    book = PeerBook("me", tmp_path, auto_ban_after=2)
    book.remember("cheat", ["/ip4/127.0.0.1/tcp/5/p2p/cheat"])
    book.remember("friend", ["/ip4/127.0.0.1/tcp/6/p2p/friend"])
    book.ban("cheat", "banned by validator v1: reward")
    book.record_rejection("noisy", "bad frame")
    book.record_rejection("noisy", "bad frame")  # auto-banned at 2
    book.save(force=True)
    doc = json.loads((tmp_path / "peers.json").read_text())
    assert {b["peer_id"] for b in doc["banned"]} == {"cheat", "noisy"}

    again = PeerBook("me", tmp_path)
    assert again.is_banned("cheat") and again.is_banned("noisy") and not again.is_banned("friend")
    assert [p for p, _ in again.remembered()] == ["friend"]  # a banned peer is not dialled back
    assert {b["peer_id"]: b["reason"] for b in again.bans()} == {
        "cheat": "banned by validator v1: reward", "noisy": "auto: 2 rejections, last: bad frame"}

    assert again.unban("noisy") and not again.unban("noisy") and not again.unban("stranger")
    again.save(force=True)
    assert [b["peer_id"] for b in PeerBook("me", tmp_path).bans()] == ["cheat"]

    # A week on, the ban is forgotten at the next start.
    doc = json.loads((tmp_path / "peers.json").read_text())
    doc["banned"][0]["at"] = time.time() - peerbook.BAN_KEPT_S - 1
    (tmp_path / "peers.json").write_text(json.dumps(doc))
    assert PeerBook("me", tmp_path).bans() == []
    # A damaged entry costs only the file's contents, never the start.
    (tmp_path / "peers.json").write_text(json.dumps({"version": 1, "peers": [], "banned": [{"at": "x"}]}))
    assert PeerBook("me", tmp_path).bans() == []


def test_a_restarted_node_still_refuses_the_peer_it_banned(tmp_path: Path) -> None:
    from intellect_node.p2p.swarm import Swarm
    from intellect_node.protocol.signing import SigningKey

    key = SigningKey.generate()

    async def start(d: Path, k: SigningKey) -> Swarm:
        return await Swarm.start(k, run_id="test", listen=["/ip4/127.0.0.1/tcp/0"],
                                 http_url="http://127.0.0.1:1", data_dir=d)

    async def main() -> None:
        a = await start(tmp_path / "a", key)
        cheat = await start(tmp_path / "cheat", SigningKey.generate())
        friend = await start(tmp_path / "friend", SigningKey.generate())
        try:
            await a.ban(cheat.peer_id, "banned by validator v1: toploc")
            # Persisted at once, not at the next periodic save.
            doc = json.loads((tmp_path / "a" / "peers.json").read_text())
            assert [b["peer_id"] for b in doc["banned"]] == [cheat.peer_id]
            await a.close()

            a = await start(tmp_path / "a", key)
            assert a.is_banned(cheat.peer_id)
            await friend.connect(a.listen_addrs()[0])
            await wait_until(lambda: friend.peer_id in a.connected_peers(), 20, what="friend connected")
            try:
                await cheat.connect(a.listen_addrs()[0])
            except Exception:  # refused outright is fine too
                pass
            await wait_until(lambda: a.peer_id not in cheat.connected_peers()
                             and cheat.peer_id not in a.connected_peers(), 20, what="the banned peer cut off")
            assert friend.peer_id in a.connected_peers() and a.is_banned(cheat.peer_id)
        finally:
            await asyncio.gather(a.close(), cheat.close(), friend.close(), return_exceptions=True)

    run(main(), timeout=180)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)


def test_peers_bans_and_unban_commands(tmp_path: Path) -> None:
    book = PeerBook("me", tmp_path)
    book.ban("12D3KooWcheat", "banned by validator v1: reward")
    book.save(force=True)
    d = str(tmp_path)

    out = _cli("peers", "bans", "--data-dir", d)
    assert out.returncode == 0 and "12D3KooWcheat" in out.stdout and "reward" in out.stdout, out
    listed = json.loads(_cli("peers", "bans", "--data-dir", d, "--json").stdout)
    assert [b["peer_id"] for b in listed] == ["12D3KooWcheat"]

    # Not while a node runs with the data dir (it holds the ban in memory and would write it back).
    from intellect_node.node.runtime import LOCK_FILE

    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        out = _cli("peers", "unban", "12D3KooWcheat", "--data-dir", d)
        assert out.returncode == 2 and "intellect-node stop" in out.stderr, out
    finally:
        os.close(fd)
    out = _cli("peers", "unban", "12D3KooWnobody", "--data-dir", d)
    assert out.returncode == 2 and "is not banned" in out.stderr and "peers bans" in out.stderr, out
    out = _cli("peers", "unban", "12D3KooWcheat", "--data-dir", d)
    assert out.returncode == 0 and "unbanned" in out.stdout, out
    assert "no banned peers" in _cli("peers", "bans", "--data-dir", d).stdout
