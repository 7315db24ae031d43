"""Shared test helpers. Area-specific fixtures live in ``tests/support_<area>.py`` modules."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
# The CLI entry point of this venv (tests drive the real console script).
CLI = str(Path(sys.executable).with_name("intellect-node"))

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The vLLM tests run under `make test-vllm` in their own environment (.venv-vllm); the main environment
# has no vLLM, so they are not collected there rather than skipped.
# (tests/ is on sys.path, so tests/inference/vllm itself would be found as a namespace package: require a real module.)
_vllm_spec = importlib.util.find_spec("vllm")
if _vllm_spec is None or _vllm_spec.origin is None:
    collect_ignore = ["inference/vllm"]


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition") -> object:
    """Poll ``predicate`` until truthy or raise after ``timeout`` seconds (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run([CLI, *args], capture_output=True, text=True, env=full_env, timeout=timeout,
                          input=input)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "node"
    d.mkdir()
    return d
