"""`intellect-node demo --headless`: a real local swarm (trainer, validator, two workers as processes)
runs N trainer steps and writes the report; every child exits 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli


@pytest.mark.timeout(480)  # four node processes start (torch + libp2p imports) on a shared 2-core machine
def test_headless_demo_runs_steps_and_reports(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    root = tmp_path / "swarm"
    r = run_cli("demo", "--headless", "--steps", "2", "--report", str(report), "--dir", str(root),
                "--timeout", "360", timeout=420)
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads(report.read_text())
    assert [s["step"] for s in doc["steps"]] == sorted({s["step"] for s in doc["steps"]})
    assert len(doc["steps"]) == 2
    for s in doc["steps"]:
        assert 0.0 <= s["pass_rate"] <= 1.0 and isinstance(s["reward_mean"], float)
    assert doc["rollouts"]["accepted"] > 0 and doc["rollouts"]["rejected"] >= 0
    assert doc["stopped_because"] == "steps reached"
    assert set(doc["exit_codes"]) == {"trainer", "validator0", "worker0", "worker1"}
    assert all(code == 0 for code in doc["exit_codes"].values()), doc["exit_codes"]
    # each worker's ledger recorded what it submitted, and it was flushed on SIGTERM
    for w in ("worker0", "worker1"):
        assert not (root / w / "ledger.sqlite-wal").exists()  # checked before a reader opens it
        led = json.loads(run_cli("ledger", "--data-dir", str(root / w), "--json").stdout)
        assert led["summary"]["batches_submitted"] >= 1


def test_step_log_keeps_steps_across_polls_and_counts_validator_verdicts() -> None:
    from intellect_node.commands.demo import StepLog, rollout_counts
    from intellect_node.node.status import StatusBoard

    trainer, validator, worker = StatusBoard(role="trainer"), StatusBoard(role="validator"), StatusBoard(role="worker")
    log = StepLog()
    for step in range(5):
        trainer.train_step(step, reward_mean=step / 10, pass_rate=step / 5)
        if step % 2:
            log.update([trainer.snapshot()])
    log.update([trainer.snapshot()])
    assert [s["step"] for s in log.ordered()] == [0, 1, 2, 3, 4]
    assert log.ordered()[3] == {"step": 3, "pass_rate": 0.6, "reward_mean": 0.3}
    validator.verdict(True, 64)
    validator.verdict(False, 64, reason="toploc")
    worker.rollouts_generated(128)
    worker.verdict(True, 64)
    snaps = [trainer.snapshot(), validator.snapshot(), worker.snapshot()]
    assert rollout_counts(snaps) == {"accepted": 64, "rejected": 64, "generated": 128}
    # without validators the workers' own counts are used
    assert rollout_counts([trainer.snapshot(), worker.snapshot()])["accepted"] == 64
