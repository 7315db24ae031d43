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


def ctrl_c_reaches_child() -> None:
    """``preexec_fn`` for a child the test interrupts with SIGINT, as a terminal's Ctrl-C would.

    A suite started as a background job of a non-interactive shell (``make test &`` in a script, some CI
    runners) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler in its
    children: the SIGINT would be dropped and the test would time out. Restoring the default first gives
    the child what an operator's terminal gives it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
