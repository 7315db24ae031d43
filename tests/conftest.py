"""pytest hooks and fixtures only. Helpers are modules under ``tests/support/`` (paths and the CLI runner in
``common``, waiting in ``wait``), imported as ``from tests.support.<area> import ...``; this file is never
imported as a module."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

# No wall-clock deadline on any property test: Hypothesis' default (200 ms an example) is a timing in a
# test, and failed on a loaded machine (`make test-loaded`: one example took 288 ms beside the burners).
settings.register_profile("intellect-node", deadline=None)
settings.load_profile("intellect-node")

# The vLLM tests run under `make test-vllm` in their own environment (.venv-vllm); the main environment
# has no vLLM, so they are not collected there rather than skipped.
# (tests/ is on sys.path, so tests/inference/vllm itself would be found as a namespace package: require a
# real module.)
_vllm_spec = importlib.util.find_spec("vllm")
if _vllm_spec is None or _vllm_spec.origin is None:
    collect_ignore = ["inference/vllm"]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "node"
    d.mkdir()
    return d
