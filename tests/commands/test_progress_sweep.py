"""`sweep polysemanticity` reports its progress through the CLI (stderr not a terminal: JSON lines) instead
of minutes of silence before its table. The command runs in this process (``tests.support.cli.invoke_cli``:
the coordinator node in it, the worker its own process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands.test_progress import EVERY_UPDATE, phases, progress_lines
from tests.support.cli import invoke_cli


@pytest.mark.slow  # a coordinator node and a worker process over the tiny grid
def test_sweep_reports_workers_jobs_and_outcome(tmp_path: Path) -> None:
    r = invoke_cli("sweep", "polysemanticity", "--grid", "tiny", "--workers", "1", "--check-fraction", "0",
                   "--out", str(tmp_path / "sweep"), env=EVERY_UPDATE)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = progress_lines(r.stderr)
    assert {rec["progress"] for rec in lines} == {lines[0]["progress"]}
    assert lines[0]["progress"].startswith("sweep tiny-")
    seen = phases(lines)
    assert seen[:2] == ["starting the coordinator", "waiting for workers"]
    assert seen[-2:] == ["stopping", "finished"]
    assert "running jobs" in seen
    running = [rec for rec in lines if rec["phase"] == "running jobs"]
    done = [rec["done"] for rec in running]
    assert done == sorted(done) and {rec["total"] for rec in running} == {6}
    assert all(rec["workers"] == 1 and rec["banned"] == 0 for rec in running[1:])
    assert "6/6 jobs done" in r.stdout and "| n | m |" in r.stdout  # the result stays on stdout
