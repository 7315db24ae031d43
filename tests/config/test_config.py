"""Configuration: TOML file < INTELLECT_NODE_* environment < flags; mistakes name the field and source."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from intellect_node.config import build_config, example_toml, field_docs, load_config
from intellect_node.errors import ConfigError
from tests.support.common import REPO, run_cli

EXAMPLE = REPO / "docs" / "config.example.toml"
PEER = "12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxuMFPuEv5zDdu"


def test_example_config_parses_and_documents_every_field() -> None:
    doc = tomllib.loads(EXAMPLE.read_text())
    cfg = build_config(doc)
    assert cfg == load_config(EXAMPLE, environ={})
    text = EXAMPLE.read_text()
    missing = []
    for path in field_docs():
        section, name = path.split(".", 1)
        block = text.split(f"[{section}]", 1)[-1].split("\n[", 1)[0]
        if not re.search(rf"^(# )?{re.escape(name)} =", block, re.M):
            missing.append(path)
    assert not missing, (f"docs/config.example.toml lacks {missing}; regenerate it with "
                         "`python -m intellect_node.config > docs/config.example.toml`")


def test_every_field_has_a_docstring_and_the_example_is_generated_from_them() -> None:
    undocumented = [k for k, v in field_docs().items() if not v.strip()]
    assert not undocumented, f"fields without a docstring: {undocumented}"
    assert tomllib.loads(example_toml()) is not None


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('[network]\nhttp_port = 8001\ncontrol_port = 8002\nheartbeat_interval = 2.0\n'
                 '[run]\nrun_id = "from-file"\nasync_level = 1\n')
    env = {"INTELLECT_NODE_NETWORK__HTTP_PORT": "9001", "INTELLECT_NODE_RUN__RUN_ID": "from-env",
           "INTELLECT_NODE_NETWORK__BOOTSTRAP": f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",
           "INTELLECT_NODE_DATA_DIR": "/not/config"}
    cfg = load_config(f, environ=env, flags={"run": {"run_id": "from-flag"}})
    assert cfg.network.http_port == 9001 and cfg.network.control_port == 8002
    assert cfg.network.heartbeat_interval == 2.0 and cfg.run.async_level == 1
    assert cfg.run.run_id == "from-flag"
    assert cfg.network.bootstrap == [f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"]
    # JSON lists and empty optional values from the environment
    env2 = {"INTELLECT_NODE_NETWORK__LISTEN": '["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/0"]',
            "INTELLECT_NODE_RUN__TRAINER_PEER_ID": ""}
    cfg2 = load_config(None, environ=env2)
    assert len(cfg2.network.listen) == 2 and cfg2.run.trainer_peer_id is None


def test_default_file_locations(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[run]\nrun_id = "in-data-dir"\n')
    assert load_config(None, environ={}, data_dir=tmp_path).run.run_id == "in-data-dir"
    other = tmp_path / "other.toml"
    other.write_text('[run]\nrun_id = "from-env-file"\n')
    assert load_config(None, environ={"INTELLECT_NODE_CONFIG": str(other)},
                       data_dir=tmp_path).run.run_id == "from-env-file"


@pytest.mark.parametrize("toml,env,needles", [
    ('[network]\nhttp_port = "eighty"\n', {}, ["network.http_port", "integer", "node.toml"]),
    ('[network]\nlistn = []\n', {},
     ["network.listn", "unknown field", "expected one of: listen", "node.toml"]),
    ('[netwrk]\n', {}, ["netwrk", "expected one of: network, run", "node.toml"]),
    ('[run]\ndtype = "int8"\n', {}, ["run.dtype", "float32"]),
    ('[network]\nheartbeat_interval = 30.0\n', {}, ["peer_timeout", "heartbeat_interval", "node.toml"]),
    ("[network\n", {}, ["not valid TOML", "line 1"]),
    ("", {"INTELLECT_NODE_NETWORK__HTTP_PORT": "99999"}, ["network.http_port", "65535",
                                                          "INTELLECT_NODE_NETWORK__HTTP_PORT"]),
    ("", {"INTELLECT_NODE_NETWORK__LISTN": "x"}, ["INTELLECT_NODE_NETWORK__LISTN", "listen"]),
    ("", {"INTELLECT_NODE_RUN_ID": "x"}, ["INTELLECT_NODE_RUN__RUN_ID", "two underscores"]),
    ("", {"INTELLECT_NODE_RL_MAXNEW_TOKENS": "8"}, ["INTELLECT_NODE_RL__MAX_NEW_TOKENS", "two underscores"]),
    ("", {"INTELLECT_NODE_PROOFZ__X": "1"}, ["no config section 'proofz'"]),
    # what peers would refuse in this node's heartbeats is refused here, at start
    ('[network]\nhttp_public_url = "http://[x"\n', {}, ["network.http_public_url", "not a URL peers accept"]),
    ('[network]\nhttp_public_url = "http://user@host:80"\n', {}, ["network.http_public_url"]),
])
def test_mistakes_name_the_field_and_where_it_was_set(tmp_path: Path, toml: str, env: dict[str, str],
                                                      needles: list[str]) -> None:
    f = tmp_path / "node.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(f, environ=env)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml", environ={})


def test_join_with_bad_config_exits_2_naming_field(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('[network]\nheartbeat_interval = "often"\n')
    r = run_cli("join", "--headless", "--data-dir", str(tmp_path / "d"), "--config", str(f), timeout=60)
    assert r.returncode == 2 and "network.heartbeat_interval" in r.stderr and str(f) in r.stderr, r.stderr
    r = run_cli("join", "--headless", "--data-dir", str(tmp_path / "d"), timeout=60,
                env={"INTELLECT_NODE_METRICS__PORT": "-1"})
    assert r.returncode == 2 and "metrics.port" in r.stderr and "INTELLECT_NODE_METRICS__PORT" in r.stderr
