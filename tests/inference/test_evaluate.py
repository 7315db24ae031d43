"""Held-out evaluation (``inference/evaluate.py``, ``intellect-node model eval``): deterministic, follows the
weights it is given, and refuses a bad weights file with exit code 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file

from intellect_node.inference.evaluate import pass_rate, with_weights
from intellect_node.models.loader import load_model
from tests.support.common import CLI


def test_same_policy_same_number_and_weights_file_is_what_is_evaluated(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    base = load_model(None)
    a, b = pass_rate(base, n=64), pass_rate(base, n=64)
    assert a == b and 0.0 < a < 1.0
    # The same weights through a file: the same figure; noised weights: a much worse one.
    save_file({k: v.contiguous() for k, v in base.state.items()}, str(tmp_path / "same.safetensors"))
    assert pass_rate(with_weights(base, tmp_path / "same.safetensors"), n=64) == a
    noisy = {k: (v + 0.5 * torch.randn_like(v)).contiguous() for k, v in base.state.items()}
    save_file(noisy, str(tmp_path / "noisy.safetensors"))
    assert pass_rate(with_weights(base, tmp_path / "noisy.safetensors"), n=64) < a / 2


def test_cli_names_the_bad_flag(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    for bad, needle in ((tmp_path / "missing.safetensors", "No such file"),
                        (tmp_path / "other.safetensors", "lacks")):
        r = subprocess.run([CLI, "model", "eval", "--n", "8", "--weights", str(bad)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "--weights" in r.stderr and needle in r.stderr, r.stderr
    ok = subprocess.run([CLI, "model", "eval", "--n", "16"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "pass rate" in ok.stdout and "on 16 problems" in ok.stdout
