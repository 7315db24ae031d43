"""An auditor that joins a run late replays a window starting at a checkpoint the trainer published.

Real processes on loopback (trainer, the run's validator, one worker, the embedded model; the trainer
checkpoints every two steps and publishes each checkpoint's weights and optimizer state as blobs named
in that step's record). Once the trainer has published a checkpoint, a second validator with
``validator.audit`` on joins: it never heard the steps from version 0, so its first window starts at a
later checkpoint, from the weights and optimizer state it fetches through the swarm. (The worker stops
while the auditor starts, so that the trainer is still early in the run, rewards still mixed, when the
auditor's window runs.)

- an honest trainer: the window replays to every published hash, and at the next checkpoint the
  replayed optimizer state is the published one; every verdict passes;
- a trainer that adds an update of its own after each step (``nudge``): the first step that trained in
  the first audited window fails, with the hash the replay made and the one published.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from intellect_node.fsutil import read_jsonl
from tests.support.roles import ENV, listen_addr, role_run, write_config
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

RL = dict(group_size=8, problems_per_batch=2, groups_per_step=2, max_new_tokens=5, batches_per_version=2,
          checkpoint_every=2, ban_after=1000, lr=5e-4)


def _audit(proc: NodeProcess) -> dict[str, Any]:
    st = proc.status()["validator"]["audit"]
    assert isinstance(st, dict), st
    return st


def _states(trainer: NodeProcess) -> list[int]:
    """The versions whose checkpoint state the trainer published."""
    return list(trainer.status()["trainer"]["records"].get("states") or [])


def _run(tmp: Path, mode: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with role_run(tmp, ("trainer", "validator", "auditor", "w1"), rl=RL) as run:
        trainer = None
        if mode is not None:
            write_config(tmp / "trainer", **run.common)
            trainer = NodeProcess(tmp / "trainer", env=ENV,
                                  argv=[sys.executable, "-m", "tests.support.dishonest_trainer", mode,
                                        str(tmp / "trainer")])
        trainer, t_addr, _, v_addr = run.trainer_and_validator(trainer)
        worker = run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        wait_for(lambda: bool(_states(trainer)), timeout=600, what="a checkpoint state published")
        # The worker pauses while the auditor starts: the trainer waits for work, so the run is still
        # young (rewards still mixed, steps still training) when the auditor hears its next checkpoint.
        worker.close()
        auditor = run.start("auditor", "validator", bootstrap=[t_addr, v_addr],
                            validator={"audit": True, "audit_fraction": 1.0})
        listen_addr(auditor)
        wait_for(lambda: auditor.status()["validator"]["versions_held"], timeout=300,
                 what="the auditor following the trainer's policy")
        run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        if mode is None:  # a whole window: from one published checkpoint to the next
            wait_for(lambda: _audit(auditor)["windows"]["pass"] >= 1, timeout=600, what="a window passed")
        else:
            wait_for(lambda: _audit(auditor)["fail"] >= 1, timeout=600, what="a failed step")
        st = _audit(auditor)
    return st, read_jsonl(tmp / "auditor" / "auditor" / "verdicts.jsonl")


def test_honest_window_from_a_later_checkpoint_passes(tmp_path: Path) -> None:
    st, verdicts = _run(tmp_path, None)
    assert st["fail"] == 0 and st["unavailable"] == 0, st
    assert st["windows"]["fail"] == 0 and st["windows"]["unavailable"] == 0, st
    assert verdicts and all(v["outcome"] == "pass" and v["expected"] == v["published"] for v in verdicts)
    first = int(verdicts[0]["window"])
    assert first >= 2, f"the first window starts at v{first}, not at a later checkpoint"
    # the window reached the next checkpoint: the record there passed, optimizer state included
    assert any(int(v["version"]) >= first + 2 for v in verdicts), verdicts


def test_nudging_trainer_is_caught_in_the_first_window(tmp_path: Path) -> None:
    st, verdicts = _run(tmp_path, "nudge")
    bad = st["first_bad"]
    assert bad["outcome"] == "fail" and bad["expected"] and bad["expected"] != bad["published"], st
    assert "replayed weights differ" in str(bad["reason"])
    first = int(verdicts[0]["window"])
    assert first >= 2 and int(bad["window"]) == first, (first, bad)
    # every step before it in that window trained nothing (a pass keeps the start's weights)
    outcomes = [v["outcome"] for v in verdicts]
    k = outcomes.index("fail")
    assert outcomes[:k] == ["pass"] * k and all(int(v["version"]) == first for v in verdicts[:k])
