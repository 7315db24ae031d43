"""A sweep on a real local swarm: the CLI starts a coordinator node and 3 worker processes on 127.0.0.1,
one of which forges its results (started by ``tests.support.sweep``). The spot checks catch
it, it is banned, its jobs are redone, and the swarm's results equal the same runs done here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.node import control
from intellect_node.p2p.identity import load_key
from intellect_node.research import sweep as S
from tests.support.common import run_cli
from tests.support.sweep import run_with_forgers
from tests.support.wait import wait_for


# The bounds leave room for a heavily shared machine (4 processes start).
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_forger_caught_banned_and_redone_on_a_local_swarm(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = run_with_forgers([0], "sweep", "polysemanticity", "--grid", "tiny", "--workers", "3",
                            "--out", str(out), "--check-fraction", "1.0", timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    forger = load_key(out / "workers" / "w0").peer_id
    honest = {load_key(out / "workers" / f"w{i}").peer_id for i in (1, 2)}

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["banned"]) == [forger]
    assert summary["done"] == summary["jobs"] == 6 and not summary["unresolved"]
    assert f"banned {forger}" in proc.stdout

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    jobs = {S.job_id(spec): spec for spec in S.grid("tiny")}
    assert {r["job_id"] for r in rows} == set(jobs)
    for r in rows:
        # Every job was re-executed (fraction 1.0) by the two honest workers, who agree with a local run.
        assert r["status"] == "done" and r["check"] == "agreed"
        assert set(r["peers"]) == honest
        local = S.execute(jobs[r["job_id"]])
        assert (r["polysemantic"], r["sign_hash"]) == local.digest

    # The journal holds the forger's refuted results and the ban; the outputs are regenerated from it.
    events = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()[1:]]
    assert any(e["e"] == "result" and e["peer"] == forger for e in events)
    assert [e["peer"] for e in events if e["e"] == "ban"] == [forger]
    (out / "summary.json").unlink()
    again = run_cli("sweep", "polysemanticity", "--out", str(out), "--resume", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((out / "summary.json").read_text())["configs"] == summary["configs"]
    assert (out / "plot.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_join_submits_to_a_running_sweep_worker(tmp_path: Path) -> None:
    wdir = tmp_path / "worker"
    wdir.mkdir()
    worker = subprocess.Popen(
        [sys.executable, "-m", "intellect_node.cli", "sweep", "worker", "--data-dir", str(wdir),
         "--run-id", "sweep", "--heartbeat-interval", "1", "--peer-timeout", "15",
         "--log-file", str(wdir / "worker.log")],
        env=dict(os.environ, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (wdir / "control.json").exists() or worker.poll() is not None, timeout=180,
                 what="the worker node to come up")
        addr = control.request(wdir, "GET", "/v1/status")["listen_addrs"][0]
        out = tmp_path / "sweep"
        proc = run_cli("sweep", "polysemanticity", "--grid", "tiny", "--join", addr, "--out", str(out),
                       "--check-fraction", "0", timeout=400)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        me = load_key(wdir).peer_id
        assert len(rows) == 6 and all(r["status"] == "done" and r["peers"] == [me] for r in rows)
        assert control.request(wdir, "GET", "/v1/status")["sweep_worker"]["jobs_done"] == 6
        assert not (out / "workers").exists()  # --join starts no local workers
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    assert worker.returncode == 0


def test_operator_mistakes_exit_2(tmp_path: Path) -> None:
    bad_grid = run_cli("sweep", "polysemanticity", "--grid", "huge", "--out", str(tmp_path / "a"))
    assert bad_grid.returncode == 2 and "--grid" in bad_grid.stderr
    no_journal = run_cli("sweep", "polysemanticity", "--out", str(tmp_path / "b"), "--resume")
    assert no_journal.returncode == 2 and "--resume" in no_journal.stderr
    workers = run_cli("sweep", "polysemanticity", "--workers", "0", "--out", str(tmp_path / "c"))
    assert workers.returncode == 2 and "--workers" in workers.stderr
