"""Pure parts of the swarm layer: topics, heartbeat/node-info decoders, config, peerbook, control file."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.config import NodeConfig, build_config
from intellect_node.errors import ConfigError, MessageIgnored, ProtocolError
from intellect_node.node import control
from intellect_node.p2p.peerbook import PeerBook
from intellect_node.protocol import gossip
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import KINDS, parse_topic, topic, validate_run_id

KEY = SigningKey(bytes(range(32)))
NOW = 1_800_000_000_000


def _hb(**kw: Any) -> gossip.Heartbeat:
    base: dict[str, Any] = dict(run_id="r1", seq=1, time_ms=NOW, http_url="http://127.0.0.1:1",
                listen_addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{KEY.peer_id}"], roles=["worker"])
    base.update(kw)
    return gossip.Heartbeat(**base)


def test_topics_round_trip_and_refuse_bad_names() -> None:
    for kind in KINDS:
        assert parse_topic(topic("run-1.a_b", kind)) == ("run-1.a_b", kind)
    for bad in ["", "Upper", "-lead", "a" * 65, "sp ace", "sl/ash"]:
        with pytest.raises(ProtocolError):
            validate_run_id(bad)
    for bad in ["/intellect/r/unknown/1", "/other/r/policy/1", "/intellect/r/policy/2", "garbage"]:
        with pytest.raises(ProtocolError):
            parse_topic(bad)


def test_heartbeat_round_trip_and_rejections() -> None:
    data = KEY.seal(gossip.HEARTBEAT_DOMAIN, _hb())
    hb, signer = gossip.open_heartbeat(data, run_id="r1", now_ms=NOW)
    assert signer == KEY.peer_id and hb == _hb()
    with pytest.raises(ProtocolError, match="run"):
        gossip.open_heartbeat(data, run_id="r2", now_ms=NOW)
    with pytest.raises(MessageIgnored, match="ago"):  # a replay: ignored, blamed on no one
        gossip.open_heartbeat(data, run_id="r1", now_ms=NOW + gossip.MAX_CLOCK_SKEW_MS + 1)
    with pytest.raises(ProtocolError):  # a heartbeat signature is no node-info signature
        gossip.open_node_info(data, expected_signer=KEY.peer_id)
    for bad in (_hb(http_url="ftp://x"), _hb(listen_addrs=["x"] * 9), _hb(roles=["r" * 33])):
        with pytest.raises(ProtocolError):
            gossip.open_heartbeat(KEY.seal(gossip.HEARTBEAT_DOMAIN, bad), run_id="r1", now_ms=NOW)


def test_node_info_must_come_from_the_stream_peer() -> None:
    info = gossip.NodeInfo(run_id="r1", time_ms=NOW, http_url="http://h:1", listen_addrs=[], roles=[])
    data = KEY.seal(gossip.NODE_INFO_DOMAIN, info)
    assert gossip.open_node_info(data, expected_signer=KEY.peer_id) == info
    with pytest.raises(ProtocolError, match="signed by"):
        gossip.open_node_info(data, expected_signer=SigningKey.generate().peer_id)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    for fn in (lambda: gossip.open_heartbeat(data, run_id="r1", now_ms=NOW),
               lambda: gossip.open_node_info(data, expected_signer=KEY.peer_id)):
        with pytest.raises(ProtocolError):
            fn()


def test_config_defaults_docs_and_errors_name_the_field() -> None:
    cfg = build_config()
    assert cfg.network.listen == ["/ip4/127.0.0.1/tcp/0"] and cfg.run.run_id == "default"
    for section in (NodeConfig, type(cfg.network), type(cfg.run)):
        for name, f in section.model_fields.items():
            assert f.description, f"{section.__name__}.{name} has no docstring"
    cases = [({"network": {"bootstrap": ["/ip4/1.2.3.4/tcp/1"]}}, "network.bootstrap"),
             ({"network": {"listen": ["nope"]}}, "network.listen"),
             ({"network": {"heartbeat_interval": 5, "peer_timeout": 5}}, "network"),
             ({"network": {"typo": 1}}, "network.typo"),
             ({"run": {"trainer_peer_id": "12D3KooWnope"}}, "run.trainer_peer_id"),
             ({"run": {"dtype": "int4"}}, "run.dtype")]
    for data, field in cases:
        assert isinstance(data, dict)
        with pytest.raises(ConfigError) as exc:
            build_config(data)
        assert exc.value.field == field and field in str(exc.value)


def test_peerbook_liveness_bans_and_remembered_peers(tmp_path: Path) -> None:
    book = PeerBook("me", tmp_path, peer_timeout=2.0, auto_ban_after=3)
    assert book.heard("p1", http_url="http://a:1") is True
    assert book.heard("p1") is False and book.http_url("p1") == "http://a:1"
    assert book.sweep(time.monotonic() + 1.0) == []
    assert book.sweep(time.monotonic() + 3.0) == ["p1"] and book.state("p1") == "gone"
    assert book.heard("p1") is True  # back from gone

    auto_banned: list[str] = []
    book.on_auto_ban = auto_banned.append
    for i in range(3):
        book.record_rejection("p2", f"bad {i}")
    assert book.is_banned("p2") and book.rejections("p2") == (3, ["bad 0", "bad 1", "bad 2"])
    assert auto_banned == ["p2"]

    book.remember("p3", ["/ip4/127.0.0.1/tcp/5/p2p/p3"])
    book.remember("me", ["/ip4/127.0.0.1/tcp/6/p2p/me"])  # never ourselves
    book.save(force=True)
    path = tmp_path / "peers.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = PeerBook("me", tmp_path)
    assert again.remembered() == [("p3", ["/ip4/127.0.0.1/tcp/5/p2p/p3"])]
    assert again.addrs("p3") == ["/ip4/127.0.0.1/tcp/5/p2p/p3"]
    again.heard("p3", addrs=["/ip4/10.0.0.3/tcp/7/p2p/p3"])  # signed addresses win
    assert again.addrs("p3") == ["/ip4/10.0.0.3/tcp/7/p2p/p3"] and again.addrs("nobody") == []
    path.write_text("{broken")
    assert PeerBook("me", tmp_path).remembered() == []  # a damaged cache costs only the cache


def test_peerbook_stays_bounded_under_a_flood_of_peer_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from intellect_node.p2p import peerbook

    monkeypatch.setattr(peerbook, "MAX_PEERS", 50)
    book = PeerBook("me")
    book.heard("friend")
    book.set_connected("friend", True)
    book.ban("enemy", "bad")
    for i in range(500):
        book.record_rejection(f"sybil{i}", "junk")
    names = {r["peer_id"] for r in book.snapshot()}
    assert len(names) <= 50 and {"friend", "enemy"} <= names


def test_control_file_is_private_and_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no node is running"):
        control.read_control_file(tmp_path)
    control.write_control_file(tmp_path, "http://127.0.0.1:5", "tok")
    assert stat.S_IMODE(os.stat(tmp_path / control.CONTROL_FILE).st_mode) == 0o600
    assert control.read_control_file(tmp_path) == ("http://127.0.0.1:5", "tok")
    with pytest.raises(ConfigError, match="does not answer"):
        control.request(tmp_path, "GET", "/v1/status", timeout=2)
    control.remove_control_file(tmp_path, "other-token")
    assert (tmp_path / control.CONTROL_FILE).exists()
    control.remove_control_file(tmp_path, "tok")
    assert not (tmp_path / control.CONTROL_FILE).exists()
    (tmp_path / control.CONTROL_FILE).write_text(json.dumps({"url": "http://evil.example:1", "token": "t"}))
    with pytest.raises(ConfigError, match="damaged"):
        control.read_control_file(tmp_path)
