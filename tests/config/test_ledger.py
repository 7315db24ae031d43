"""The ledger: durable before acknowledged, idempotent verdicts, summaries, and the `ledger` command."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from intellect_node.config.ledger import Ledger
from intellect_node.errors import ConfigError
from tests.support.cli import invoke_cli


def _fill(led: Ledger) -> None:
    led.record_submission("b1", run_id="r1", policy_version=3, n_rollouts=16, n_tokens=512)
    led.record_submission("b2", run_id="r1", policy_version=4, n_rollouts=16, n_tokens=500)
    led.record_submission("b3", run_id="r2", policy_version=0, n_rollouts=8, n_tokens=100)
    led.record_verdict("b1", validator="V1", run_id="r1", n_accepted=16, n_rejected=0)
    led.record_verdict("b2", validator="V1", run_id="r1", n_accepted=0, n_rejected=16,
                       reason="toploc_mismatch", detail="exp mismatches 41 > 10")
    led.record_verdict("zz", validator="V1", run_id="r1", n_accepted=0, n_rejected=4, reason="stale_policy")


def test_summary_pending_unknown_and_per_run(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as led:
        _fill(led)
        s = led.summary()
        assert (s.batches_submitted, s.rollouts_submitted, s.tokens_submitted) == (3, 40, 1112)
        assert (s.rollouts_accepted, s.rollouts_rejected, s.verdicts_received) == (16, 20, 3)
        assert s.batches_pending == 1 and s.unknown_batch_verdicts == 1
        assert s.rejection_reasons == {"toploc_mismatch": 16, "stale_policy": 4}
        assert s.runs == ("r1", "r2") and s.acceptance_rate == pytest.approx(16 / 36)
        r2 = led.summary(run_id="r2")
        assert r2.batches_submitted == 1 and r2.batches_pending == 1 and r2.verdicts_received == 0
        recent = led.recent(2)
        assert [r["batch_id"] for r in recent] == ["b3", "b2"]
        assert recent[1]["rejected"] == 16 and recent[1]["reasons"] == "toploc_mismatch"


def test_redelivered_verdicts_and_resubmissions_count_once(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite") as led:
        assert led.record_submission("b", run_id="r", policy_version=1, n_rollouts=4, n_tokens=9)
        assert not led.record_submission("b", run_id="r", policy_version=1, n_rollouts=4, n_tokens=9)
        assert led.record_verdict("b", validator="V", run_id="r", n_accepted=4, n_rejected=0)
        assert not led.record_verdict("b", validator="V", run_id="r", n_accepted=0, n_rejected=4, reason="x")
        assert led.record_verdict("b", validator="V2", run_id="r", n_accepted=4, n_rejected=0)
        s = led.summary()
        assert s.rollouts_accepted == 8 and s.rollouts_rejected == 0 and s.verdicts_received == 2


def test_wal_mode_and_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    led = Ledger(path)

    def write(k: int) -> None:
        for i in range(50):
            led.record_submission(f"{k}-{i}", run_id="r", policy_version=i, n_rollouts=1, n_tokens=1)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # a reader (the CLI) sees the writes while the writer still holds the file open
    with Ledger(path, readonly=True) as reader:
        assert reader.summary().batches_submitted == 200
    led.close()


_KILLED_WRITER = """
import os, sys
from intellect_node.config.ledger import Ledger
led = Ledger(sys.argv[1])
led.record_submission("acked", run_id="r", policy_version=1, n_rollouts=2, n_tokens=3)
led.record_verdict("acked", validator="V", run_id="r", n_accepted=2, n_rejected=0)
print("ACK", flush=True)           # what a worker does after the record call returns
sys.stdin.readline()               # then it is killed without any shutdown
"""


def test_recorded_means_on_disk_even_if_killed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ACK"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    with Ledger(path, readonly=True) as led:
        s = led.summary()
    assert s.batches_submitted == 1 and s.rollouts_accepted == 2


def test_bad_ledger_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no ledger"):
        Ledger(tmp_path / "missing.sqlite", readonly=True)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="not a readable ledger"):
        Ledger(junk)


def test_ledger_command_text_and_json(data_dir: Path) -> None:
    with Ledger.in_data_dir(data_dir) as led:
        _fill(led)
    r = invoke_cli("ledger", "--data-dir", str(data_dir), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["summary"]["rollouts_accepted"] == 16 and doc["summary"]["batches_pending"] == 1
    assert [b["batch_id"] for b in doc["recent"]] == ["b3", "b2", "b1"]
    text = invoke_cli("ledger", "--data-dir", str(data_dir), "--run", "r1")
    assert text.returncode == 0, text.stderr
    assert "toploc_mismatch" in text.stdout and "pending" in text.stdout.lower()
    missing = invoke_cli("ledger", "--data-dir", str(data_dir / "nope"))
    assert missing.returncode == 2 and "no ledger" in missing.stderr


def _receipts(led: Ledger) -> None:
    """b1 trained at v5 (1 of its 2 groups), b4 (another worker's) trained, b5 equal rewards, b6 stale;
    b2 was rejected and b7 accepted with no record yet."""
    from intellect_node.config.ledger import Receipt

    led.record_submission("b7", run_id="r1", policy_version=4, n_rollouts=8, n_tokens=100)
    led.record_verdict("b7", validator="V1", run_id="r1", n_accepted=8, n_rejected=0)
    for b in ("b5", "b6"):
        led.record_submission(b, run_id="r1", policy_version=2, n_rollouts=8, n_tokens=100)
    led.record_step(run_id="r1", seq=6, step=5, version=5, receipts=[
        Receipt("b1", "me", "trained", groups=2, groups_trained=1, rollouts_trained=8),
        Receipt("b4", "other", "trained", groups=2, groups_trained=2, rollouts_trained=16),
        Receipt("b6", "me", "stale", groups=2, groups_trained=0, rollouts_trained=0)])
    led.record_step(run_id="r1", seq=7, step=5, version=5, receipts=[
        Receipt("b5", "me", "equal_rewards", groups=2, groups_trained=0, rollouts_trained=0)])


def test_receipts_trained_dropped_and_untrained(tmp_path: Path) -> None:
    from intellect_node.config.ledger import Receipt

    with Ledger(tmp_path / "ledger.sqlite") as led:
        _fill(led)
        _receipts(led)
        # a replayed step names the same batch again: the first record stays
        assert led.record_step(run_id="r1", seq=9, step=8, version=8, receipts=[
            Receipt("b1", "me", "trained", groups=2, groups_trained=2, rollouts_trained=16)]) == 0
        s = led.summary(run_id="r1")
        assert (s.batches_trained, s.rollouts_trained) == (1, 8)  # b4 is another worker's batch
        assert s.batches_dropped == {"equal_rewards": 1, "stale": 1}
        assert s.batches_admitted_untrained == 1  # b7
        rows = {r["batch_id"]: r for r in led.recent(10)}
        assert rows["b1"]["trained_outcome"] == "trained" and rows["b1"]["trained_version"] == 5
        assert rows["b2"]["trained_outcome"] is None and rows["b7"]["trained_outcome"] is None
        workers = {w["worker"]: w for w in led.trained_by_worker(run_id="r1")}
        assert workers["other"]["rollouts_trained"] == 16 and workers["me"]["rollouts_trained"] == 8
        assert (workers["me"]["stale"], workers["me"]["equal_rewards"]) == (1, 1)


def test_ledger_command_shows_receipts_and_every_worker(data_dir: Path) -> None:
    with Ledger.in_data_dir(data_dir) as led:
        _fill(led)
        _receipts(led)
    doc = json.loads(invoke_cli("ledger", "--data-dir", str(data_dir), "--json", "--all").stdout)
    assert doc["summary"]["batches_trained"] == 1
    assert {w["worker"] for w in doc["workers"]} == {"me", "other"}
    text = invoke_cli("ledger", "--data-dir", str(data_dir), "--all", "--recent", "20",
                      env={"COLUMNS": "200"})
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "v5 (1/2 groups)" in out and "dropped: stale" in out and "dropped: equal_rewards" in out
    assert "admitted, not yet trained" in out and "every worker" in out


def test_a_ledger_from_before_receipts_reads(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        _fill(led)
    db = sqlite3.connect(path)
    db.execute("DROP TABLE trained")
    db.commit()
    db.close()
    with Ledger(path, readonly=True) as led:
        assert led.summary().batches_trained == 0 and led.trained_by_worker() == []
        assert led.recent(1)[0]["trained_outcome"] is None


def test_accepted_batch_no_record_names_past_the_bound(data_dir: Path) -> None:
    """b7 (v4, accepted, named by no record) is admitted and not yet trained while the records heard are
    at base v6 (async_level 1: v4 is stale from base v6 on, and one version of slack), and dropped without a
    record once a record at base v7 is heard."""
    from intellect_node.config.ledger import Receipt

    with Ledger.in_data_dir(data_dir) as led:
        _fill(led)
        _receipts(led)
        led.record_step(run_id="r1", seq=10, step=9, version=7, base_version=6, async_level=1, receipts=[
            Receipt("b8", "other", "trained", groups=2, groups_trained=2, rollouts_trained=16)])
        s = led.summary(run_id="r1")
        assert (s.batches_admitted_untrained, s.batches_unrecorded) == (1, 0)
        led.record_step(run_id="r1", seq=11, step=10, version=8, base_version=7, async_level=1, receipts=[
            Receipt("b9", "other", "trained", groups=2, groups_trained=2, rollouts_trained=16)])
        s = led.summary(run_id="r1")
        assert (s.batches_admitted_untrained, s.batches_unrecorded) == (0, 1)
        assert {r["batch_id"]: r["past_bound"] for r in led.recent(20)}["b7"] == 1
        # an older record heard later does not move the run's head back
        led.record_step(run_id="r1", seq=3, step=2, version=3, base_version=2, async_level=1, receipts=[])
        assert led.summary(run_id="r1").batches_unrecorded == 1
    text = invoke_cli("ledger", "--data-dir", str(data_dir), "--recent", "20", env={"COLUMNS": "200"})
    assert text.returncode == 0, text.stderr
    assert "dropped without a record" in text.stdout and "admitted, not yet trained" not in text.stdout
