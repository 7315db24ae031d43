"""A validator with ``validator.audit`` on replays the trainer's steps from its signed records.

Real processes on loopback (trainer, auditing validator, one worker, the embedded model):

- an honest trainer passes every audited step, and the validator's status says so;
- a trainer that trains with twice the run's learning rate while its records state the run's, and one
  that adds an update of its own after each step, fail the first step that trained, with the hash the
  replay made and the one published (the evidence in ``auditor/verdicts.jsonl``).
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
AUDITED = 3  # trained steps passed before the honest run stops


def _audit(proc: NodeProcess) -> dict[str, Any]:
    st = proc.status()["validator"]["audit"]
    assert isinstance(st, dict), st
    return st


def _passed_version(tmp: Path) -> int:
    """The newest version an audit passed (-1: none)."""
    return max((int(str(v["version"])) for v in read_jsonl(tmp / "validator" / "auditor" / "verdicts.jsonl")
                if v.get("outcome") == "pass"), default=-1)


def _run(tmp: Path, mode: str | None) -> tuple[dict[str, Any], list[dict[str, object]]]:
    with role_run(tmp, ("trainer", "validator", "w1"), rl=RL, validator={"audit": True}) as run:
        trainer = None
        if mode is not None:
            write_config(tmp / "trainer", **run.common)
            trainer = NodeProcess(tmp / "trainer", env=ENV,
                                  argv=[sys.executable, "-m", "tests.support.dishonest_trainer", mode,
                                        str(tmp / "trainer")])
        _, t_addr, validator, v_addr = run.trainer_and_validator(trainer)
        run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        if mode is None:
            # passes up to version 2 at least: two trained steps among them
            wait_for(lambda: _audit(validator)["pass"] >= AUDITED and _passed_version(tmp) >= 2,
                     timeout=600, what=f"{AUDITED} steps audited, two of them trained")
        else:
            wait_for(lambda: _audit(validator)["state"] == "stopped", timeout=600, what="the audit stopped")
        st = _audit(validator)
    return st, read_jsonl(tmp / "validator" / "auditor" / "verdicts.jsonl")


def test_honest_trainer_passes_every_audit(tmp_path: Path) -> None:
    st, verdicts = _run(tmp_path, None)
    assert st["fail"] == 0 and st["unavailable"] == 0 and st["state"] == "following", st
    assert verdicts and all(v["outcome"] == "pass" for v in verdicts)
    assert all(v["expected"] == v["published"] for v in verdicts)


@pytest.mark.parametrize("mode", ["lr", "nudge"])
def test_dishonest_trainer_is_caught(tmp_path: Path, mode: str) -> None:
    st, verdicts = _run(tmp_path, mode)
    assert st["fail"] == 1 and st["first_bad"]["outcome"] == "fail", st
    bad = st["first_bad"]
    assert bad["expected"] and bad["expected"] != bad["published"]
    assert "replayed weights differ" in str(bad["reason"])
    # every step before it was one that trained nothing (all passes keep the base policy)
    assert [v["outcome"] for v in verdicts] == ["pass"] * (len(verdicts) - 1) + ["fail"]
