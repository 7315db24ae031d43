"""``intellect-node runs``: the table it prints, and what it says without a peer to ask (exit 2 naming
--bootstrap). Listing runs through a swarm: tests/system/test_run_by_cid.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from intellect_node.commands.runs import _pick, render
from intellect_node.errors import ConfigError
from tests.support.cli import invoke_cli


def test_the_table_has_a_row_per_run_with_unknowns_as_dashes() -> None:
    rows = [{"run_id": "qwen3-cid", "model": "qwen3", "env": "reasoning_gym:chain_sum",
             "organiser": "12D3KooWabcdefgh12345678", "cid": "bafkreiexample",
             "nodes": {"worker": 3, "trainer": 1},
             "policy_version": 7, "step": 7, "age_s": 4000},
            {"run_id": "other", "model": "m", "env": "add3", "organiser": "12D3KooWzzzzzzzz87654321",
             "cid": "bafkreiother", "nodes": {}, "policy_version": -1, "step": -1, "age_s": 30}]
    lines = render(rows).splitlines()
    assert lines[0].split() == ["RUN", "MODEL", "ENV", "ORGANISER", "CID", "NODES", "VERSION", "STEP",
                                "HELD-OUT", "AGE"]
    assert lines[1].split() == ["qwen3-cid", "qwen3", "reasoning_gym:chain_sum", "12345678", "bafkreiexample",
                                "trainer=1", "worker=3", "7", "7", "-", "66m"]
    assert lines[2].split() == ["other", "m", "add3", "87654321", "bafkreiother", "-", "-", "-", "-", "30s"]


def test_without_a_peer_to_ask_it_names_the_flag(tmp_path: Path) -> None:
    out = invoke_cli("runs", "--data-dir", str(tmp_path / "d"))
    assert out.returncode == 2 and "--bootstrap" in out.stderr, out.stderr


def test_a_run_id_naming_several_manifests_is_refused_with_the_list() -> None:
    assert _pick("r1", [("bafkreione", "12D3KooWa", "3m")]) == "bafkreione"
    with pytest.raises(ConfigError, match=r"--run r1 names 2 runs: bafkreione \(organiser 12D3KooWa, 3m "
                                          r"old\); bafkreitwo \(organiser 12D3KooWb, 5s old\); pass the CID"):
        _pick("r1", [("bafkreione", "12D3KooWa", "3m"), ("bafkreitwo", "12D3KooWb", "5s")])
    with pytest.raises(ConfigError, match="no run with that ID"):
        _pick("r1", [])


def test_a_lookup_listens_where_the_node_would_on_a_free_port() -> None:
    from intellect_node.roles.runs import lookup_listen

    assert lookup_listen(["/ip4/0.0.0.0/tcp/4001"]) == "/ip4/0.0.0.0/tcp/0"
    assert lookup_listen(["/ip4/192.168.1.5/tcp/4001", "/ip4/127.0.0.1/tcp/1"]) == "/ip4/192.168.1.5/tcp/0"
    assert lookup_listen([]) == "/ip4/127.0.0.1/tcp/0"
