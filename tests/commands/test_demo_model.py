"""``demo --model DIR --env ...``: a model brought without thresholds gets a calibrated pair, and the
demo's run config carries the environment (the swarm itself is the headless demo test's subject)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from intellect_node.commands.demo import DEMO_RL, DemoSwarm, demo_thresholds
from intellect_node.config import load_config
from intellect_node.proofs.thresholds import load_thresholds
from intellect_node.testing.models import make_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3")


def test_a_model_without_thresholds_is_calibrated_into_the_demo_dir(qwen3: Path, tmp_path: Path) -> None:
    said: list[str] = []
    path = demo_thresholds(str(qwen3), tmp_path, progress=said.append)
    assert path == tmp_path / "proof_thresholds.json" and not (qwen3 / "proof_thresholds.json").exists()
    assert "float32/torch@cpu->torch@cpu" in json.loads(path.read_text())["pairs"]
    assert load_thresholds(qwen3, "float32", path).exp_mismatches >= 2
    assert said and "calibrating" in said[0]
    # the embedded model ships its thresholds: used as they are
    from intellect_node.models.loader import embedded_model_dir

    assert demo_thresholds(str(embedded_model_dir()), tmp_path / "e") == embedded_model_dir() / \
        "proof_thresholds.json"


def test_the_demo_config_carries_model_env_and_thresholds(qwen3: Path, tmp_path: Path) -> None:
    thresholds = demo_thresholds(str(qwen3), tmp_path)
    extra = {"rl": {**DEMO_RL, "env": "reasoning_gym:basic_arithmetic"},
             "run": {"proof_thresholds": str(thresholds)}}
    swarm = DemoSwarm(tmp_path / "swarm", workers=1, validators=1, run_id="demo-t", model=str(qwen3),
                      extra_config=extra)
    cfg = load_config(swarm.config_path, environ={})
    assert cfg.rl.env == "reasoning_gym:basic_arithmetic"
    assert cfg.run.model == str(qwen3) and cfg.run.proof_thresholds == str(thresholds)
    assert cfg.run.trainer_peer_id == swarm.trainer.peer_id
