"""Paths and the CLI runner every test area uses (``tests/conftest.py`` keeps only pytest hooks/fixtures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).with_name("intellect-node"))
"""The console script of the venv running the tests: tests drive the real CLI, not its functions."""


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``intellect-node *args`` to completion with ``env`` added to ours; output captured as text."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run([CLI, *args], capture_output=True, text=True, env=full_env, timeout=timeout,
                          input=input)
