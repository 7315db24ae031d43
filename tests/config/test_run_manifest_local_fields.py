"""A run manifest sets only the run's shared settings (``config/run_manifest.py``): one that
names this machine's paths (``rl.tasks_file``, ``rl.solve_rates_file``, ``run.model``), its local
choices (``rl.train_device``, ``rl.checkpoint_every``) or another section is refused naming the field,
whatever the node's own layers say."""

from __future__ import annotations

from pathlib import Path

import pytest

from intellect_node.config.run_manifest import config_from_manifest
from intellect_node.errors import ProtocolError
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.run_manifest import ModelFile, RunManifest, canonical_json
from intellect_node.protocol.signing import SigningKey

ORGANISER = SigningKey.generate()


def _manifest(shared: dict[str, dict[str, object]]) -> RunManifest:
    return RunManifest(format="intellect-node/run/1", run_id="r1", organiser=ORGANISER.peer_id,
                       created_ms=1, model_name="m",
                       model_files=[ModelFile(path="config.json", blob=cid_of(b"c"), size=1)],
                       config=canonical_json(shared), thresholds="{}")


@pytest.mark.parametrize(("section", "name", "value"), [
    ("rl", "tasks_file", "/etc/passwd"),
    ("rl", "solve_rates_file", "/home/me/.ssh/id_ed25519"),
    ("rl", "train_device", "cuda:7"),
    ("rl", "checkpoint_every", 1),
    ("run", "model", "/somewhere/else"),
    ("run", "proof_thresholds_sha256", "0" * 64),
])
def test_a_manifest_setting_a_field_of_this_machine_is_refused(tmp_path: Path, section: str, name: str,
                                                               value: object) -> None:
    shared: dict[str, dict[str, object]] = {"run": {"run_id": "r1"}, "rl": {}}
    shared[section][name] = value
    with pytest.raises(ProtocolError, match=rf"{section}\.{name}.*not a shared run setting"):
        config_from_manifest(_manifest(shared), local={}, origin={}, model_dir=tmp_path / "model",
                             thresholds=tmp_path / "t.json")


def test_a_manifest_setting_another_section_is_refused(tmp_path: Path) -> None:
    shared: dict[str, dict[str, object]] = {"run": {"run_id": "r1"}, "rl": {},
                                            "network": {"bootstrap": ["/ip4/1.2.3.4/tcp/1/p2p/x"]}}
    with pytest.raises(ProtocolError, match=r"network.*not a shared run setting"):
        config_from_manifest(_manifest(shared), local={}, origin={}, model_dir=tmp_path / "model",
                             thresholds=tmp_path / "t.json")


def test_unset_machine_files_a_manifest_carries_as_null_are_accepted(tmp_path: Path) -> None:
    """``run_sections`` writes ``tasks_file`` and ``solve_rates_file`` as null: that sets nothing."""
    shared: dict[str, dict[str, object]] = {"run": {"run_id": "r1"},
                                            "rl": {"tasks_file": None, "solve_rates_file": None}}
    cfg = config_from_manifest(_manifest(shared), local={"rl": {"train_device": "cpu"}},
                               origin={"rl.train_device": "--train-device"}, model_dir=tmp_path / "model",
                               thresholds=tmp_path / "t.json")
    assert cfg.rl.tasks_file is None and cfg.rl.train_device == "cpu"
