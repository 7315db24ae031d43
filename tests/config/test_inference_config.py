"""The ``[inference]`` section and the run's engine-pair thresholds: what a node chooses, what it refuses."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from intellect_node.config import build_config
from intellect_node.errors import ConfigError
from intellect_node.inference import choose_engine
from intellect_node.proofs.thresholds import (
    Calibration,
    Observed,
    load_thresholds,
    merge_into,
    pair_key,
)
from intellect_node.roles.common.engines import engine_choice, require_rollout_engine, run_thresholds
from intellect_node.testing.models import make_model

torch.set_num_threads(1)
PEER = "12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxuMFPuEv5zDdu"


@pytest.mark.parametrize("engine, device, installed, want", [
    ("auto", "cpu", True, "torch"), ("auto", "cuda", True, "vllm"), ("auto", "cuda:1", False, "torch"),
    ("torch", "cuda", True, "torch"), ("vllm", "cpu", True, "vllm")])
def test_auto_is_vllm_only_on_cuda_with_vllm_installed(engine: str, device: str, installed: bool,
                                                       want: str) -> None:
    name, why = choose_engine(engine, device, vllm_installed=installed)
    assert name == want and why
    if engine == "auto" and device.startswith("cuda") and not installed:
        assert "vllm is not installed" in why


def test_defaults_keep_the_torch_engine_on_cpu() -> None:
    cfg = build_config()
    assert (cfg.inference.engine, cfg.inference.device) == ("auto", "cpu")
    choice = engine_choice(cfg, "worker")
    assert (choice.name, choice.kind) == ("torch", "torch@cpu")
    require_rollout_engine(cfg, choice)  # the default run admits it
    assert choice.vllm["max_model_len"] == cfg.inference.max_prompt_tokens + cfg.rl.max_new_tokens


@pytest.mark.parametrize("section, field, message", [
    ({"device": "gpu0"}, "inference.device", "'gpu0' is not a device; use cpu, cuda or cuda:N"),
    ({"device": "cuda:99"}, "inference.device", "cuda:99"),
    ({"engine": "tensorrt"}, "inference.engine", "auto"),
    ({"vllm_gpu_memory_fraction": 1.5}, "inference.vllm_gpu_memory_fraction", "1"),
])
def test_bad_inference_settings_name_the_field(section: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_config({"inference": section})
    assert info.value.field == field


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_and_vllm_without_vllm_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="CUDA is not available here") as info:
        build_config({"inference": {"device": "cuda"}})
    assert info.value.field == "inference.device"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="vllm is not installed") as info:
            build_config({"inference": {"engine": "vllm"}})
        assert info.value.field == "inference.engine"


def test_join_exits_2_naming_the_inference_field(tmp_path: Path) -> None:
    env = {**os.environ, "INTELLECT_NODE_INFERENCE__DEVICE": "cuda:7", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "intellect_node.cli", "join", "--data-dir", str(tmp_path),
                          "--headless"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2
    assert "inference.device" in res.stderr and "INTELLECT_NODE_INFERENCE__DEVICE" in res.stderr


def test_a_worker_whose_engine_the_run_does_not_admit_refuses_to_start() -> None:
    cfg = build_config({"run": {"rollout_engines": ["vllm@cuda"]}})
    with pytest.raises(ConfigError, match="would generate with torch@cpu") as info:
        require_rollout_engine(cfg, engine_choice(cfg, "worker"))
    assert info.value.field == "run.rollout_engines"
    with pytest.raises(ConfigError, match="engine@device"):
        build_config({"run": {"rollout_engines": ["torch@tpu"]}})


def _cal(engine: str, device: str, worst_exp: int, model: str = "") -> Calibration:
    return Calibration(dtype="float32", engines=[engine], batch_sizes=[1], max_new_tokens=8,
                       observed=Observed(rollouts=4, exp_mismatches=worst_exp), device=device, model=model)


def test_pairs_are_stored_apart_and_a_run_uses_the_loosest_it_admits(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.json"
    for cal in (_cal("torch", "cpu", 1), _cal("vllm", "cuda", 5)):
        path.write_text(json.dumps(merge_into(path, cal)))
    data = json.loads(path.read_text())
    assert data["format"] == 2
    assert set(data["pairs"]) == {"float32/torch@cpu->torch@cpu", "float32/vllm@cuda->torch@cpu"}
    torch_only = load_thresholds(tmp_path, "float32", path)
    both = load_thresholds(tmp_path, "float32", path, generators=["torch@cpu", "vllm@cuda"])
    assert (torch_only.exp_mismatches, both.exp_mismatches) == (4, 12)  # worst * 2 + 2
    with pytest.raises(ConfigError, match=r"no thresholds for the engine pair float32/vllm@cpu->torch@cpu"):
        load_thresholds(tmp_path, "float32", path, generators=["vllm@cpu"])
    with pytest.raises(ConfigError, match="float32/torch@cpu->torch@cuda"):
        load_thresholds(tmp_path, "float32", path, verify_device="cuda:0")


def test_the_runs_hash_and_the_models_architecture_must_match(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps(merge_into(path, _cal("torch", "cpu", 0, model="aaaa"))))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_thresholds(tmp_path, "float32", path, sha256=digest, fingerprint="aaaa").exp_mismatches == 2
    with pytest.raises(ConfigError, match="not the run's") as info:
        load_thresholds(tmp_path, "float32", path, sha256="0" * 64)
    assert info.value.field == "run.proof_thresholds_sha256"
    with pytest.raises(ConfigError, match="another architecture"):
        load_thresholds(tmp_path, "float32", path, fingerprint="bbbb")


def test_the_shipped_dtype_keyed_file_reads_as_cpu_pairs() -> None:
    from intellect_node.models.loader import embedded_model_dir

    d = embedded_model_dir()
    th = load_thresholds(d, "float32", generators=["torch@cpu", "vllm@cpu"])
    assert th == load_thresholds(d, "float32")
    assert pair_key("float32", "vllm@cuda:3", "cuda:1") == "float32/vllm@cuda->torch@cuda"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3")


def test_calibrated_qwen3_run_accepts_honest_rollouts_and_rejects_tampered(qwen3: Path,
                                                                          tmp_path: Path) -> None:
    """`proofs calibrate` on a real family writes the pair with the model's fingerprint; a validator
    built from the run config (file, hash, engines) accepts honest rollouts and rejects a changed token."""
    out = tmp_path / "run-thresholds.json"
    res = subprocess.run([sys.executable, "-m", "intellect_node.cli", "proofs", "calibrate", "--model",
                          str(qwen3), "--n", "8", "--batch-sizes", "1,4", "--max-new-tokens", "8", "--out",
                          str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert f"sha256 {digest}" in res.stdout
    entry = json.loads(out.read_text())["pairs"]["float32/torch@cpu->torch@cpu"]
    assert entry["model"] and entry["observed"]["rollouts"] == 16

    cfg = build_config({"run": {"model": str(qwen3), "proof_thresholds": str(out),
                                "proof_thresholds_sha256": digest, "trainer_peer_id": PEER}})
    thresholds = run_thresholds(cfg, qwen3)
    from intellect_node.envs.tasks import embedded_task
    from intellect_node.inference import SamplingConfig, make_engine
    from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
    from intellect_node.inference.verifier import Expectations, Verifier
    from intellect_node.protocol.rollout import sign_rollout
    from intellect_node.protocol.signing import SigningKey

    engine = make_engine(qwen3, "torch")
    problems = embedded_task().sample(random.Random(3), 4)
    cid = checkpoint_cid(qwen3)
    sampling = SamplingConfig(max_new_tokens=8)
    key = SigningKey(bytes(32))
    recs = generate_rollouts(engine, engine.loaded.tokenizer, problems, key=key, run_id="r",
                             policy_version=0, checkpoint=cid, sampling=sampling, seeds=[11, 12, 13, 14])
    verifier = Verifier(engine, thresholds, Expectations(run_id="r", checkpoint_cid=cid))
    assert all(v.accepted for v in verifier.verify(recs)), verifier.verify(recs)

    # A worker that edits one token of its own rollout and signs it: only the tensor checks can tell.
    import msgspec

    bad = recs[0]
    tokens = list(bad.completion_tokens)
    i = len(tokens) // 2
    tokens[i] = 3 + (tokens[i] + 7) % 300
    forged = sign_rollout(msgspec.structs.replace(bad, completion_tokens=tokens), key)
    verdict = verifier.verify([forged])[0]
    assert not verdict.accepted and verdict.reason != "signature", verdict
