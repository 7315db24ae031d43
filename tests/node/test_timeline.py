"""The node's own join timeline (issue #15 part 3): seconds from process start to ready, first peer,
first policy held, first batch submitted and first batch accepted.

The board's rules are checked with injected clocks (a stage is marked once, by the setter that reports
it); the origin against a real child process's start; and the whole join on a real swarm (trainer,
validator and a fresh worker as ``intellect-node join`` processes on the embedded model), read the
three ways an operator reads it: ``/v1/status``, ``status --json`` and the human summary.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config.status import (
    TIMELINE_STAGES,
    StatusBoard,
    StatusSnapshot,
    Timeline,
    process_started_at,
)
from tests.support.common import CLI
from tests.support.roles import role_run
from tests.support.wait import wait_for


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_setters_mark_their_stage_once_counted_from_the_process_start() -> None:
    clock = Clock(1000.0)
    board = StatusBoard(clock=clock, started_at=990.0)
    assert board.snapshot().timeline == Timeline(process_started_at=990.0)

    clock.now = 1001.0
    board.set_state("starting")
    board.set_peers(0)
    board.set_policy(current=3)  # announced in the swarm is not held here
    tl = board.snapshot().timeline
    assert (tl.ready, tl.first_peer, tl.first_policy) == (None, None, None)

    board.set_state("running")
    clock.now = 1002.5
    board.set_peers(2, trainers=["t"])
    clock.now = 1004.0
    board.set_policy(local=0)
    clock.now = 1005.0
    board.mark("first_batch_submitted")
    clock.now = 1007.25
    board.mark("first_batch_accepted")

    clock.now = 1100.0  # later events move nothing
    board.set_state("running")
    board.set_peers(1)
    board.set_policy(local=1)
    board.mark("first_batch_submitted")
    board.mark("first_batch_accepted")
    tl = board.snapshot().timeline
    assert tl.stages() == [("ready", 11.0), ("first_peer", 12.5), ("first_policy", 14.0),
                           ("first_batch_submitted", 15.0), ("first_batch_accepted", 17.25)]
    assert [name for name, _ in tl.stages()] == list(TIMELINE_STAGES)


def test_an_unknown_stage_is_refused_and_a_repeat_mark_changes_nothing() -> None:
    board = StatusBoard(clock=Clock(10.0), started_at=9.0)
    with pytest.raises(ValueError, match="first_batch"):
        board.mark("first_batch")
    board.mark("first_peer")
    seq = board.snapshot().seq
    board.mark("first_peer")  # no change, no listener woken
    assert board.snapshot().seq == seq


def test_an_origin_after_now_is_clamped_and_the_timeline_round_trips_json() -> None:
    board = StatusBoard(clock=Clock(50.0), started_at=80.0)  # a clock stepped back: never negative
    board.set_state("running")
    snap = board.snapshot()
    assert snap.timeline.process_started_at == 50.0 and snap.timeline.ready == 0.0
    doc = snap.to_dict()
    assert doc["timeline"] == {"process_started_at": 50.0, "ready": 0.0, "first_peer": None,
                               "first_policy": None, "first_batch_submitted": None,
                               "first_batch_accepted": None}
    assert StatusSnapshot.from_json(snap.to_json()).timeline == snap.timeline
    # a status from a node without a timeline (older version) still reads
    old = snap.to_json().replace(b'"timeline"', b'"timeline_old"')
    assert StatusSnapshot.from_json(old).timeline == Timeline()


def test_process_start_is_the_child_process_start_not_its_first_call() -> None:
    code = ("import time\n"
            "from intellect_node.config.status import process_started_at\n"
            "deadline = time.monotonic() + 0.3\n"
            "while time.monotonic() < deadline: pass\n"  # busy, so the age is at least this, by construction
            "print(time.time() - process_started_at())")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    wall = time.time() - before
    age = float(out.stdout)
    assert 0.3 <= age <= wall + 0.02, (age, wall)  # the kernel counts starts in 10 ms ticks
    here = process_started_at()
    assert here is not None and here <= time.time()


RL = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=5, lr=2e-4,
          batches_per_version=2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_worker_reports_its_join_in_status(tmp_path: Path) -> None:
    with role_run(tmp_path, ("trainer", "validator"), rl=RL) as run:
        trainer, t_addr, validator, v_addr = run.trainer_and_validator()
        (tmp_path / "worker").mkdir()  # a fresh worker: no key yet, join makes one
        launched = time.time() - 0.02  # the kernel counts starts in 10 ms ticks
        worker = run.start("worker", "worker", bootstrap=[t_addr, v_addr])
        worker.wait_ready(180)

        def accepted() -> dict[str, Any] | None:
            st = worker.status()
            return st if st["snapshot"]["timeline"]["first_batch_accepted"] is not None else None
        st = wait_for(accepted, timeout=400, interval=0.5, what="the worker's first accepted batch")
        assert isinstance(st, dict)
        tl = st["snapshot"]["timeline"]
        marks = [tl[s] for s in TIMELINE_STAGES]
        assert all(isinstance(m, float) and m >= 0 for m in marks), tl
        # a worker submits only what it generated with a policy, and a verdict follows a submission (the
        # roles start before the node reads "running", so ready may come after the policy)
        assert tl["first_policy"] <= tl["first_batch_submitted"] <= tl["first_batch_accepted"]
        assert tl["process_started_at"] >= launched  # the worker's own process, not an older one

        cli = worker.cli_status()
        assert cli["snapshot"]["timeline"]["first_batch_accepted"] == tl["first_batch_accepted"]
        human = subprocess.run([CLI, "status", "--data-dir", str(tmp_path / "worker")], capture_output=True,
                               text=True, timeout=60, check=True).stdout
        line = next(x for x in human.splitlines() if x.startswith("timeline"))
        assert f"accepted {tl['first_batch_accepted']:.1f} s" in line and "policy" in line, human
        # the trainer holds its own policy and has peers, but submits nothing
        ttl = trainer.status()["snapshot"]["timeline"]
        assert ttl["first_policy"] is not None and ttl["first_batch_submitted"] is None

