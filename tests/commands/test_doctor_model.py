"""``doctor --model``: the memory estimate against real tensors, and the verdicts an operator reads. The
commands run in this process (``tests.support.cli.invoke_cli``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from intellect_node.inference.memory import (
    kv_cache_bytes,
    model_shape,
    params_from_config,
    params_from_weights,
    role_estimate,
    training_bytes,
    weight_bytes,
)
from intellect_node.testing.models import FAMILIES, make_model
from tests.support.cli import invoke_cli

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {f: make_model(root / f, f) for f in FAMILIES}
    out["qwen3-untied"] = make_model(root / "qwen3-untied", "qwen3", tied=False)
    return out


def _hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3-untied"])
def test_parameter_bytes_equal_the_loaded_tensors(models: dict[str, Path], name: str) -> None:
    path = models[name]
    cfg = json.loads((path / "config.json").read_text())
    shape = model_shape(path)
    for dtype, td in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = _hf(path, td)
        real = sum(p.numel() for p in model.parameters())  # tied embeddings counted once, as stored
        assert shape.exact and shape.n_params == real == params_from_weights(path) == params_from_config(cfg)
        assert weight_bytes(shape, dtype) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_kv_cache_formula_equals_the_cache_a_forward_builds(models: dict[str, Path], name: str) -> None:
    shape = model_shape(models[name])
    model = _hf(models[name])
    batch, tokens = 3, 11
    with torch.no_grad():
        out = model(torch.randint(3, 200, (batch, tokens)), use_cache=True)
    cache = out.past_key_values
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv_cache_bytes(shape, "float32", tokens=tokens, batch=batch) == real


def test_training_state_equals_weights_grads_and_adamw_moments(models: dict[str, Path]) -> None:
    shape = model_shape(models["qwen3-untied"])
    model = _hf(models["qwen3-untied"]).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 200, (2, 9))
    model(ids, labels=ids).loss.backward()
    opt.step()
    params = list(model.parameters())
    real = sum(p.nbytes for p in params) + sum(p.grad.nbytes for p in params if p.grad is not None)
    real += sum(t.nbytes for st in opt.state.values() for k, t in st.items() if k != "step")
    assert training_bytes(shape, "float32") == real
    # bf16 training: bf16 weights and gradients, float32 moments and master weights
    assert training_bytes(shape, "bfloat16") == shape.n_params * (2 + 2 + 8 + 4)


def test_role_estimates_name_their_parts(models: dict[str, Path]) -> None:
    shape = model_shape(models["qwen3"])
    w = weight_bytes(shape, "float32")
    kv = kv_cache_bytes(shape, "float32", tokens=100, batch=8)
    assert role_estimate(shape, "worker", "float32", batch=8, tokens=100).total == 2 * w + kv
    assert role_estimate(shape, "worker", "float32", batch=8, tokens=100, engine="vllm").total == w + kv
    val = role_estimate(shape, "validator", "float32", batch=8, tokens=100, versions=3)
    assert val.parts["weights x4"] == 4 * w
    with pytest.raises(ValueError, match="role 'miner'"):
        role_estimate(shape, "miner", "float32", batch=1, tokens=1)


def _doctor(*args: str, env: dict[str, str] | None = None, cwd: Path) -> subprocess.CompletedProcess[str]:
    return invoke_cli("doctor", "--data-dir", str(cwd), *args, env=env)


def test_doctor_model_says_each_role_fits_with_the_numbers(models: dict[str, Path], tmp_path: Path) -> None:
    res = _doctor("--model", str(models["qwen3"]), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert set(checks) == {"model size", "worker memory", "validator memory", "trainer memory"}
    assert "0.3M parameters (counted from the weights)" in checks["model size"]["detail"]
    assert all(c["status"] == "ok" for c in checks.values())
    assert "KV cache" in checks["worker memory"]["detail"] and "free" in checks["worker memory"]["detail"]


def test_doctor_model_fails_a_role_that_does_not_fit_and_says_what_to_change(models: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    # 64 problems x 256 samples of 1M-token contexts: terabytes of KV cache on any machine.
    env = {"INTELLECT_NODE_INFERENCE__MAX_PROMPT_TOKENS": str(1 << 20),
           "INTELLECT_NODE_RL__GROUP_SIZE": "256", "INTELLECT_NODE_RL__PROBLEMS_PER_BATCH": "64"}
    res = _doctor("--model", str(models["qwen3"]), "--role", "worker", "--json", env=env, cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    worker = {c["name"]: c for c in json.loads(res.stdout)}["worker memory"]
    assert worker["status"] == "fail"
    assert "batch 16384" in worker["detail"] and "GiB" in worker["detail"]
    assert "rl.problems_per_batch" in worker["detail"] and "bfloat16" in worker["detail"]


@pytest.mark.parametrize("args, field", [(["--role", "miner"], "--role 'miner'"),
                                         (["--device", "cuda"], "CUDA is not available"),
                                         (["--device", "tpu"], "'tpu' is not a device"),
                                         (["--dtype", "int8"], "--dtype 'int8'")])
def test_doctor_model_refuses_bad_flags_with_exit_2(models: dict[str, Path], tmp_path: Path, args: list[str],
                                                    field: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        args = ["--device", f"cuda:{torch.cuda.device_count()}"]
        field = "CUDA device"
    res = _doctor("--model", str(models["qwen3"]), *args, cwd=tmp_path)
    assert res.returncode == 2
    assert field in res.stderr


def test_join_refuses_a_role_that_does_not_fit_before_starting(models: dict[str, Path],
                                                               tmp_path: Path) -> None:
    env = {"INTELLECT_NODE_INFERENCE__MAX_PROMPT_TOKENS": str(1 << 20),
           "INTELLECT_NODE_RL__GROUP_SIZE": "256", "INTELLECT_NODE_RL__PROBLEMS_PER_BATCH": "64",
           "INTELLECT_NODE_RUN__MODEL": str(models["qwen3"])}
    res = invoke_cli("join", "--data-dir", str(tmp_path / "d"), "--role", "trainer", "--headless", env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "inference.memory_check" in res.stderr and "GiB" in res.stderr
    assert not (tmp_path / "d" / "control.json").exists()  # it never started
