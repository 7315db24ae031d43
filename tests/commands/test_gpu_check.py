"""``scripts/gpu-check.py`` (``make test-gpu``): what can be checked without a GPU. The script's ``main``
runs in this process (loaded from its file), its printed output captured."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.py"


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _run(script: ModuleType, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``gpu-check.py *args``: its exit code (argparse's own exit included), stdout and stderr."""
    threads = torch.get_num_threads()
    try:
        code = script.main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        torch.set_num_threads(threads)  # main() sets one thread, as its own process
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer needs a machine without CUDA")
def test_without_cuda_it_says_so_and_fails_unless_allowed(script: ModuleType,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(script, capsys)
    assert code == 1
    assert "no CUDA device here" in out and "nothing was checked" in out
    code, out, _ = _run(script, capsys, "--allow-no-gpu")
    assert code == 0 and "no CUDA device here" in out


def test_bad_arguments_exit_2(script: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(script, capsys, "--family", "gpt2")
    assert code == 2 and "invalid choice: 'gpt2'" in err


def test_the_same_steps_run_on_cpu_and_print_one_summary(script: ModuleType,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The script's own logic (model, engines, calibration, cross checks, trainer step) between GPU runs."""
    code, out, err = _run(script, capsys, "--device", "cpu", "--skip-vllm", "--dtype", "float32",
                          "--rollouts", "8", "--new-tokens", "16")
    assert code == 0, out[-3000:] + err[-3000:]
    summary = out.split("== gpu-check summary:", 1)[1]
    for step in ("build model", "torch engine", "calibrate pairs", "torch rollouts verify",
                 "tampered torch rollout rejected", "other weights' torch rollouts rejected", "trainer step"):
        assert f"ok   {step}" in summary
    assert "tok/s" in summary and "== all passed" in summary
