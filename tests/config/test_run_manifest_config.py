"""A node's configuration from a run manifest: the shared settings come from the manifest, a shared
field set locally as well is refused naming it, local fields and other sections stay the node's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from intellect_node.config.loader import build_config
from intellect_node.config.run_manifest import config_from_manifest, run_sections
from intellect_node.errors import ConfigError
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.run_manifest import ModelFile, RunManifest, canonical_json
from intellect_node.protocol.signing import SigningKey

ORGANISER, TRAINER = SigningKey.generate(), SigningKey.generate()


def _manifest(shared: dict[str, dict[str, object]]) -> RunManifest:
    return RunManifest(format="intellect-node/run/1", run_id="r1", organiser=ORGANISER.peer_id,
                       created_ms=1, model_name="m",
                       model_files=[ModelFile(path="config.json", blob=cid_of(b"c"), size=1)],
                       config=canonical_json(shared), thresholds="{}")


def test_shared_sections_round_trip_through_a_manifest(tmp_path: Path) -> None:
    organiser_cfg = build_config({"run": {"run_id": "r1", "trainer_peer_id": TRAINER.peer_id,
                                          "model": "/organiser/model", "proof_thresholds": "/o/t.json"},
                                  "rl": {"env": "reasoning_gym:chain_sum", "lr": 5e-5,
                                         "train_device": "cpu"}})
    shared = run_sections(organiser_cfg)
    assert "model" not in shared["run"] and "train_device" not in shared["rl"]
    assert "proof_thresholds_sha256" not in shared["run"]
    m = _manifest(shared)
    local = {"network": {"http_host": "127.0.0.1"}, "rl": {"reward_timeout_s": 9}}
    cfg = config_from_manifest(m, local=local, origin={"rl.reward_timeout_s": "--config x.toml"},
                               model_dir=tmp_path / "model", thresholds=tmp_path / "t.json")
    assert cfg.run.trainer_peer_id == TRAINER.peer_id and cfg.rl.lr == 5e-5
    assert cfg.run.model == str(tmp_path / "model") and cfg.run.proof_thresholds == str(tmp_path / "t.json")
    assert cfg.run.proof_thresholds_sha256 == m.thresholds_sha256
    assert cfg.rl.reward_timeout_s == 9 and cfg.network.http_host == "127.0.0.1"


def test_a_shared_field_set_locally_is_refused_naming_it(tmp_path: Path) -> None:
    m = _manifest({"run": {"run_id": "r1"}, "rl": {}})
    with pytest.raises(ConfigError, match=r"run.run_id \(set in --run-id\) comes from the run manifest"):
        config_from_manifest(m, local={"run": {"run_id": "other"}}, origin={"run.run_id": "--run-id"},
                             model_dir=tmp_path, thresholds=tmp_path / "t.json")


def test_settings_this_version_does_not_know_are_refused(tmp_path: Path) -> None:
    m = _manifest({"run": {"run_id": "r1"}, "rl": {"future_knob": 1}})
    with pytest.raises(ConfigError, match="refused by this node.*rl.future_knob"):
        config_from_manifest(m, local={}, origin={}, model_dir=tmp_path, thresholds=tmp_path / "t.json")


def test_files_of_the_organisers_machine_cannot_go_into_a_manifest() -> None:
    cfg = build_config({"rl": {"env": "reasoning_gym:chain_sum", "solve_rates_file": "/x.json"}})
    with pytest.raises(ConfigError, match="rl.solve_rates_file"):
        run_sections(cfg)
