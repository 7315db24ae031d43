"""The node's own join timeline: seconds from process start to ready, first peer,
first policy held, first batch submitted and first batch accepted.

The board's rules are checked with injected clocks (a stage is marked once, by the setter that reports
it) and the origin against a real child process's start. The whole join on a real swarm (a fresh worker
joining a trainer and a validator as ``intellect-node join`` processes on the embedded model), read the
three ways an operator reads it (``/v1/status``, ``status --json`` and the human summary), is
``tests/roles/test_roles_e2e.py``'s, on its run.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from intellect_node.config.status import (
    TIMELINE_STAGES,
    StatusBoard,
    StatusSnapshot,
    Timeline,
    process_started_at,
)


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
