"""Nodes as separate processes through the real CLI: join, status, heartbeats, remembered peers, stop."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from intellect_node.commands.join import build_node_config
from intellect_node.errors import ConfigError
from intellect_node.protocol.signing import SigningKey
from tests.support.cli import invoke_cli
from tests.support.ports import free_port
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

HB = ["--heartbeat-interval", "0.5", "--peer-timeout", "2"]


def _dead_addr() -> str:
    return f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SigningKey.generate().peer_id}"


def _cli_status(node: NodeProcess) -> dict[str, Any]:
    """``status --json`` of a running node (the command in this process; the node is a process)."""
    out = invoke_cli("status", "--data-dir", str(node.data_dir), "--json")
    assert out.returncode == 0, out.stderr
    status: dict[str, Any] = json.loads(out.stdout)
    return status


def _peer_state(node: NodeProcess, peer: str) -> str:
    for rec in node.status()["known_peers"]:
        if rec["peer_id"] == peer:
            state: str = rec["state"]
            return state
    return "unknown"


@pytest.mark.slow
def test_join_status_gone_remembered_and_clean_stop(tmp_path: Path) -> None:
    a = NodeProcess(tmp_path / "a", *HB)
    b: NodeProcess | None = None
    try:
        st_a = a.wait_ready()
        b = NodeProcess(tmp_path / "b", "--bootstrap", st_a["listen_addrs"][0], *HB)
        b_id = b.wait_ready()["peer_id"]

        st = _cli_status(a)
        assert st["peer_id"] == st_a["peer_id"]
        assert st["listen_addrs"] and all(x.endswith(f"/p2p/{st['peer_id']}") for x in st["listen_addrs"])
        wait_for(lambda: b_id in _cli_status(a)["peers"], 15, what="B in A's connected peers")
        wait_for(lambda: _peer_state(a, b_id) == "alive", 15, what="A hears B's heartbeats")

        # A second node on the same data dir is an operator mistake: exit 2, the first keeps running.
        dup = invoke_cli("join", "--data-dir", str(tmp_path / "a"), "--headless")
        assert dup.returncode == 2 and "already running" in dup.stderr, dup.stderr

        # SIGSTOP: B keeps its TCP connection but stops answering; heartbeats, not connections, decide.
        b.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: _peer_state(a, b_id) == "gone", 8, what="frozen B marked gone")
            assert b_id in a.status()["peers"]  # still "connected" at the libp2p level
        finally:
            b.signal(signal.SIGCONT)
        wait_for(lambda: _peer_state(a, b_id) == "alive", 15, what="B back after SIGCONT")

        # SIGKILL: no goodbye; A must mark B gone within peer_timeout (2 s) + one sweep (0.5 s).
        b.signal(signal.SIGKILL)
        b.wait(10)
        wait_for(lambda: _peer_state(a, b_id) == "gone", 8, what="B marked gone")
        assert json.loads((tmp_path / "b" / "peers.json").read_text())["peers"][0]["peer_id"] == st["peer_id"]

        # B comes back with a dead bootstrap peer: it finds A through peers.json.
        b.close()
        b = NodeProcess(tmp_path / "b", "--bootstrap", _dead_addr(), *HB)
        assert b.wait_ready()["peer_id"] == b_id
        wait_for(lambda: st["peer_id"] in b.status()["peers"], 20, what="B reconnects via remembered peers")
        wait_for(lambda: _peer_state(a, b_id) == "alive", 15, what="A hears B again")

        for node in (a, b):
            node.signal(signal.SIGTERM)
        assert a.wait(30) == 0, a.log()
        assert b.wait(30) == 0, b.log()
        assert not (tmp_path / "a" / "control.json").exists()
        gone = invoke_cli("status", "--data-dir", str(tmp_path / "a"), "--json")
        assert gone.returncode == 2 and "no node is running" in gone.stderr
    finally:
        a.close()
        if b is not None:
            b.close()


def test_operator_mistakes_exit_2_naming_the_flag(tmp_path: Path) -> None:
    d = str(tmp_path / "n")
    cases = [
        (["join", "--data-dir", d, "--headless", "--bootstrap", "not-a-multiaddr"], "--bootstrap"),
        (["join", "--data-dir", d, "--headless", "--run-id", "Bad Run"], "--run-id"),
        (["status", "--data-dir", d], "no node is running"),
    ]
    for args, needle in cases:
        out = invoke_cli(*args)
        assert out.returncode == 2, (args, out.returncode, out.stderr)
        assert needle in out.stderr, (args, out.stderr)
    # The same path in-process (the CLI turns ConfigError into exit 2, as shown above).
    for flags, needle in [({"bootstrap": ["/ip4/127.0.0.1/tcp/4001"]}, "/p2p/"),
                          ({"listen": ["/ip4/127.0.0.1/udp/1"]}, "--listen"),
                          ({"announce": ["nope"]}, "--announce")]:
        kwargs: dict[str, Any] = dict(
            listen=[], bootstrap=[], run_id=None, trainer_peer_id=None, http_host=None, http_port=None,
            http_public_url=None, control_port=None, heartbeat_interval=None, peer_timeout=None,
            data_dir=tmp_path / "n")
        kwargs.update(flags)
        with pytest.raises(ConfigError, match=re.escape(needle)):
            build_node_config(**kwargs)
