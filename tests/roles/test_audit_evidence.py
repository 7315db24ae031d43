"""The auditor checks admission from the step records: the evidence of each batch taken, work dropped.

Real processes on loopback (trainer, a validator with ``validator.audit`` on, an honest worker, the
embedded model; ``run.async_level`` 1 so a batch's deadline comes two versions after it):

- an honest trainer, beside a worker whose batches the validator rejects (inflated rewards), passes every
  audited step: each batch it took carries its acceptance, every accepted batch is named by a record;
- a trainer that trains on the rejected batches (taking a rejection as an acceptance) fails the first
  step that took one: its evidence is a rejection;
- a trainer that silently drops the first batch its validator accepted fails the first step past that
  batch's deadline, naming the batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from intellect_node.fsutil import read_jsonl
from tests.support.roles import ENV, role_run, write_config
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RL = dict(group_size=8, problems_per_batch=2, groups_per_step=2, max_new_tokens=5, batches_per_version=2,
          checkpoint_every=1000, ban_after=1000, lr=1e-3)


def _audit(proc: NodeProcess) -> dict[str, Any]:
    st = proc.status()["validator"]["audit"]
    assert isinstance(st, dict), st
    return st


def _passed_version(tmp: Path) -> int:
    """The newest version an audit passed (-1: none)."""
    return max((int(str(v["version"])) for v in read_jsonl(tmp / "validator" / "auditor" / "verdicts.jsonl")
                if v.get("outcome") == "pass"), default=-1)


def _records(tmp: Path) -> dict[int, dict[str, Any]]:
    """The trainer's step records by seq, as published (``trainer/records/``)."""
    from intellect_node.protocol.signing import open_envelope
    from intellect_node.protocol.steps import MAX_RECORD_BYTES, STEP_DOMAIN, StepRecord

    out = {}
    for path in sorted((tmp / "trainer" / "trainer" / "records").glob("*.rec")):
        rec, _ = open_envelope(path.read_bytes(), STEP_DOMAIN, StepRecord, max_size=MAX_RECORD_BYTES)
        out[rec.seq] = {"base": rec.base_version, "taken": {b.cid: b.worker for b in rec.batches},
                        "named": {b.cid for b in (*rec.batches, *rec.stale)} | {d.cid for d in rec.dropped}}
    return out


def _run(tmp: Path, mode: str | None, cheat: bool
         ) -> tuple[dict[str, Any], list[dict[str, object]], dict[str, str], dict[str, Any]]:
    """The audit state and verdicts once done, the peer IDs, and the trainer's status."""
    names = ("trainer", "validator", "w1", "c1") if cheat else ("trainer", "validator", "w1")
    with role_run(tmp, names, rl=RL, validator={"audit": True}, async_level=1) as run:
        trainer = None
        if mode is not None:
            write_config(tmp / "trainer", **run.common)
            trainer = NodeProcess(tmp / "trainer", env=ENV,
                                  argv=[sys.executable, "-m", "tests.support.dishonest_trainer", mode,
                                        str(tmp / "trainer")])
        trainer, t_addr, validator, v_addr = run.trainer_and_validator(trainer)
        run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        if cheat:
            run.cheat("c1", "reward", bootstrap=[t_addr, v_addr])
        if mode is None:
            # past version 2 (every batch of version 0 has met its deadline, async_level 1), and a batch of
            # the cheat refused by the trainer on its validator's rejection
            wait_for(lambda: _passed_version(tmp) >= 3
                     and trainer.status()["trainer"]["rejected_batches"] >= 1,
                     timeout=600, what="steps up to version 3 audited and a cheat's batch rejected")
        else:
            wait_for(lambda: _audit(validator)["state"] == "stopped", timeout=600, what="the audit stopped")
        st = _audit(validator)
        t_status = trainer.status()["trainer"]
    return st, read_jsonl(tmp / "validator" / "auditor" / "verdicts.jsonl"), run.ids, t_status


def test_honest_trainer_passes_admission_checks(tmp_path: Path) -> None:
    st, verdicts, ids, t_status = _run(tmp_path, None, cheat=True)
    assert st["fail"] == 0 and st["unavailable"] == 0 and st["state"] == "following", st
    assert verdicts and all(v["outcome"] == "pass" for v in verdicts)
    taken = [w for r in _records(tmp_path).values() for w in r["taken"].values()]
    assert ids["w1"] in taken and ids["c1"] not in taken


def test_trainer_training_on_rejected_batch_is_caught(tmp_path: Path) -> None:
    st, verdicts, ids, _ = _run(tmp_path, "rejected", cheat=True)
    assert st["fail"] == 1 and st["first_bad"]["outcome"] == "fail", st
    bad = st["first_bad"]
    assert "was rejected by validator" in str(bad["reason"]) and ids["c1"] in str(bad["reason"]), bad
    assert [v["outcome"] for v in verdicts] == ["pass"] * (len(verdicts) - 1) + ["fail"]
    # caught in the first step that took one of the cheat's batches
    records = _records(tmp_path)
    first = min(seq for seq, r in records.items() if ids["c1"] in r["taken"].values())
    assert bad["seq"] == first, (bad, records)


def test_trainer_dropping_accepted_batch_is_caught(tmp_path: Path) -> None:
    st, verdicts, _, t_status = _run(tmp_path, "drop", cheat=False)
    cid = t_status["dropped_silently"]
    assert cid, t_status
    assert st["fail"] == 1 and st["first_bad"]["outcome"] == "fail", st
    bad = st["first_bad"]
    reason = str(bad["reason"])
    assert f"accepted batch {cid}" in reason and "never trained nor recorded" in reason, bad
    assert [v["outcome"] for v in verdicts] == ["pass"] * (len(verdicts) - 1) + ["fail"]
    records = _records(tmp_path)
    assert all(cid not in r["named"] for r in records.values())
    # The first batch accepted is of version 0, heard before any record: its deadline is base version 2
    # (0 + async_level 1 + 1). Caught at the first record from that base on, not later.
    assert bad["seq"] == min(seq for seq, r in records.items() if r["base"] >= 2), (bad, records)
