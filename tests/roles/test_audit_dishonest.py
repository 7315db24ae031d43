"""Dishonest trainers, each caught at the first step that holds its change, and shown failed on every node.

Each test is one run of real processes on loopback (the embedded model): a trainer from
``tests/support/dishonest_trainer.py``, its validator with ``validator.audit`` on (replaying every step
from version 0, one window: ``rl.checkpoint_every`` 1000) and an honest worker ``w1``:

- ``lr``: trains with twice the run's learning rate while its records state the run's; the first step
  that trained (version 1) fails, with the hash the replay made and the one published;
- ``rejected`` (beside a worker ``c1`` whose batches the validator rejects: it claims reward 1.0 for every
  rollout): takes a rejection as an acceptance; the first step that took one of ``c1``'s batches fails
  on its evidence, a rejection by the validator naming ``c1``;
- ``drop`` (``run.async_level`` 1: a batch's deadline comes two versions after it): silently drops the
  first batch its validator accepted, named by no record; the first step from that batch's deadline on
  fails, naming the batch;
- ``claim``: drops the first batch its validator accepted (an honest worker's assigned window) and names
  it in its next record as dropped ``not_assigned``; that record fails, naming the batch: the auditor
  fetched it and the trainer's own check takes it.

In each, every step before the failed one passed, the auditor stops, and every node (trainer, validator,
workers) shows the audit ``failed`` at that step (``run.require_audits`` off: nothing stops).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.audit_run import (
    RL,
    audit_of,
    records,
    role_status,
    shows_failed,
    start_swarm,
    verdicts,
)
from tests.support.roles import role_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _caught(tmp: Path, mode: str, *, cheat: bool = False, **config: Any
            ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str], dict[str, Any]]:
    """Run ``mode``'s trainer until its auditor stopped and every node shows the failed step: the audit
    state, the auditor's verdicts, the peer IDs and the trainer's status."""
    names = ("trainer", "validator", "w1", "c1") if cheat else ("trainer", "validator", "w1")
    with role_run(tmp, names, rl=RL, validator={"audit": True}, **config) as run:
        sw = start_swarm(run, mode, cheats=("c1",) if cheat else ())
        trainer, validator = sw.trainer, sw.validator
        wait_for(lambda: audit_of(validator)["state"] == "stopped", timeout=600, what="the audit stopped")
        st = audit_of(validator)
        seq = int(st["first_bad"]["seq"])
        wait_for(lambda: all(shows_failed(p, seq) for p in sw.nodes), timeout=120,
                 what=f"every node showing step {seq} failed")
        t_status = role_status(trainer, "trainer")
    mine = verdicts(tmp / "validator")
    assert st["fail"] == 1 and st["first_bad"]["outcome"] == "fail", st
    assert [v["outcome"] for v in mine] == ["pass"] * (len(mine) - 1) + ["fail"], mine
    return st["first_bad"], mine, run.ids, t_status


def test_trainer_with_another_learning_rate_is_caught(tmp_path: Path) -> None:
    bad, mine, _, _ = _caught(tmp_path, "lr")
    assert bad["expected"] and bad["expected"] != bad["published"], bad
    assert "replayed weights differ" in str(bad["reason"]), bad
    # the first step that trained: every step before it trained nothing (each kept version 0)
    assert int(bad["version"]) == 1 and all(int(v["version"]) == 0 for v in mine[:-1]), mine


def test_trainer_training_on_rejected_batch_is_caught(tmp_path: Path) -> None:
    bad, _, ids, _ = _caught(tmp_path, "rejected", cheat=True, async_level=1)
    assert "was rejected by validator" in str(bad["reason"]) and ids["c1"] in str(bad["reason"]), bad
    recs = records(tmp_path / "trainer")
    first = min(seq for seq, r in recs.items() if ids["c1"] in r["taken"].values())
    assert bad["seq"] == first, (bad, recs)


def test_trainer_dropping_accepted_batch_is_caught(tmp_path: Path) -> None:
    bad, _, _, t_status = _caught(tmp_path, "drop", async_level=1)
    cid = t_status["dropped_silently"]
    assert cid, t_status
    reason = str(bad["reason"])
    assert f"accepted batch {cid}" in reason and "never trained nor recorded" in reason, bad
    recs = records(tmp_path / "trainer")
    assert all(cid not in r["named"] for r in recs.values())
    # The first batch accepted is of version 0, heard before any record: its deadline is base version 2
    # (0 + async_level 1 + 1). Caught at the first record from that base on, not later.
    assert bad["seq"] == min(seq for seq, r in recs.items() if r["base"] >= 2), (bad, recs)


def test_trainer_dropping_accepted_batch_as_not_assigned_is_caught(tmp_path: Path) -> None:
    bad, _, _, t_status = _caught(tmp_path, "claim")
    cid = t_status["dropped_claimed"]
    assert cid, t_status
    reason = str(bad["reason"])
    assert f"batch {cid}" in reason and "(not_assigned)" in reason and "own check takes it" in reason, bad
    recs = records(tmp_path / "trainer")
    assert bad["seq"] == min(seq for seq, r in recs.items() if cid in r["named"]), (bad, recs)
