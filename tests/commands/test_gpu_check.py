"""``scripts/gpu-check.py`` (``make test-gpu``): what can be checked without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer needs a machine without CUDA")
def test_without_cuda_it_says_so_and_fails_unless_allowed() -> None:
    res = _run()
    assert res.returncode == 1
    assert "no CUDA device here" in res.stdout and "nothing was checked" in res.stdout
    allowed = _run("--allow-no-gpu")
    assert allowed.returncode == 0 and "no CUDA device here" in allowed.stdout


def test_bad_arguments_exit_2() -> None:
    res = _run("--family", "gpt2")
    assert res.returncode == 2 and "invalid choice: 'gpt2'" in res.stderr


def test_the_same_steps_run_on_cpu_and_print_one_summary() -> None:
    """The script's own logic (model, engines, calibration, cross checks, trainer step) between GPU runs."""
    res = _run("--device", "cpu", "--skip-vllm", "--dtype", "float32", "--rollouts", "8",
               "--new-tokens", "16")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = res.stdout.split("== gpu-check summary:", 1)[1]
    for step in ("build model", "torch engine", "calibrate pairs", "torch rollouts verify",
                 "tampered torch rollout rejected", "other weights' torch rollouts rejected", "trainer step"):
        assert f"ok   {step}" in summary
    assert "tok/s" in summary and "== all passed" in summary
