"""Dishonest sweep workers for the sweep tests: the real CLI with some local workers replaced by forgers.

    python -m tests.support.sweep forgers 0,2 sweep polysemanticity --workers 3 ...   # the coordinator
    python -m tests.support.sweep forge-worker --data-dir D ...                        # one forger

``forgers I,J ARGS``: ``intellect-node ARGS`` where local workers I and J are started as forgers (through
the sweep command's ``local_worker_argv`` seam). ``forge-worker FLAGS``: ``intellect-node sweep worker
FLAGS`` running :class:`ForgingWorker`, which returns invented results without training, so the tests can
watch the spot checks catch and ban it. Cheating code lives here, not in the product.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from typing import Any

from intellect_node.protocol import sweep as wire
from intellect_node.roles.sweep import SweepWorker
from tests.support.common import REPO

log = logging.getLogger("forger")


def forged_result(spec: wire.JobSpec) -> Any:
    """What a lazy cheat returns instead of training: a plausible count, a random hash."""
    from intellect_node.research.polysemanticity import RunResult

    curve = tuple((s * spec.record_every, 0.5) for s in range(wire.curve_points(spec)))
    return RunResult(polysemantic=secrets.randbelow(min(spec.m, 8) + 1), sign_hash=secrets.token_hex(32),
                     final_loss=0.1, fourth_norm=curve)


class ForgingWorker(SweepWorker):
    """A sweep worker that signs forged results (the same claims, grants and messages as an honest one)."""

    def __init__(self, swarm: Any, **kw: Any) -> None:
        super().__init__(swarm, execute=forged_result, **kw)
        log.warning("this worker FORGES its results (tests.support.sweep)")

    def status(self) -> dict[str, Any]:
        return {**super().status(), "forging": True}


def run_with_forgers(forgers: list[int], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``intellect-node *args`` (a ``sweep polysemanticity`` with local workers) with ``forgers`` forging;
    output captured as text, like ``tests.support.common.run_cli``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tests.support.sweep", "forgers",
                           ",".join(str(i) for i in forgers), *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)


def _cli(args: list[str]) -> None:
    from intellect_node.cli import main

    sys.argv = ["intellect-node", *args]
    main()


def _forgers_main(indices: set[int], args: list[str]) -> None:
    from intellect_node.commands import sweep as command

    honest = command.local_worker_argv

    def argv(index: int, flags: list[str]) -> list[str]:
        if index in indices:
            return [sys.executable, "-m", "tests.support.sweep", "forge-worker", *flags]
        return honest(index, flags)

    command.local_worker_argv = argv  # the seam the sweep command starts its local workers through
    _cli(args)


def _forge_worker_main(flags: list[str]) -> None:
    from intellect_node.node import assembly

    honest = assembly.sweep_worker_node

    def forging_node(*a: Any, **kw: Any) -> Any:
        return honest(*a, **{**kw, "worker": ForgingWorker})

    assembly.sweep_worker_node = forging_node
    _cli(["sweep", "worker", *flags])


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "forgers":
        _forgers_main({int(x) for x in sys.argv[2].split(",") if x}, sys.argv[3:])
    elif len(sys.argv) >= 2 and sys.argv[1] == "forge-worker":
        _forge_worker_main(sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} forgers I,J ARGS... | forge-worker FLAGS...")
