"""StatusBoard and StatusSnapshot: counters, bounded histories, JSON round trip, strict decoding."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.node.status import (
    FIRST_LEN,
    HISTORY_LEN,
    RECENT_LEN,
    BoardLogHandler,
    StatusBoard,
    StatusSnapshot,
)
from tests.support.operator_node import FakeClock, busy_board


def test_counters_and_derived_values() -> None:
    clock = FakeClock()
    s = busy_board(clock).snapshot()
    assert s.role == "worker" and s.run.run_id == "demo-run" and s.peers.count == 3
    assert (s.policy.current, s.policy.local, s.policy.staleness) == (5, 3, 2)
    assert s.rollouts.generated == 32 and s.rollouts.submitted == 32 and s.rollouts.batches_submitted == 1
    assert (s.rollouts.accepted, s.rollouts.rejected) == (16, 16)
    assert s.rollouts.last_rejections[-1].reason == "toploc_mismatch"
    assert s.proofs.acceptance_rate == 0.5 and s.proofs.failures_by_reason == {"logprob": 1}
    # 1200 tokens over the 10 s between the first and the last report
    assert s.throughput.tokens_total == 1200 and s.throughput.tokens_per_s == pytest.approx(120.0)
    assert s.shards.active[0].bytes_done == 100 and s.shards.bytes_downloaded == 100
    assert s.training.step == 1 and s.training.history[0].pass_rate == 0.5
    assert s.warnings[-1].message == "bootstrap peer down"
    assert s.uptime_s == pytest.approx(10.0)


def test_rate_window_expires_and_policy_current_never_goes_back() -> None:
    clock = FakeClock()
    b = busy_board(clock)
    clock.t += 1000
    assert b.snapshot().throughput.tokens_per_s == 0.0
    b.set_policy(current=2)
    assert b.snapshot().policy.current == 5
    b.set_policy(local=7)  # a trainer loads what it just produced: current follows
    assert b.snapshot().policy.current == 7 and b.snapshot().policy.staleness == 0


def test_histories_are_bounded_and_shards_drop_when_done() -> None:
    b = StatusBoard()
    for i in range(HISTORY_LEN + 50):
        b.train_step(i, reward_mean=0.0, pass_rate=0.0)
        b.warn(f"w{i}")
        b.verdict(False, reason=f"r{i}")
    s = b.snapshot()
    assert len(s.training.history) == HISTORY_LEN and s.training.history[-1].step == HISTORY_LEN + 49
    assert [p.step for p in s.training.first] == list(range(FIRST_LEN))  # the start, kept
    assert StatusSnapshot.from_json(s.to_json()).training.first == s.training.first
    assert len(s.warnings) == RECENT_LEN and len(s.rollouts.last_rejections) == RECENT_LEN
    b.shard_progress("c1", "s", 1, 2)
    b.shard_done("c1", new_bytes=2)
    s = b.snapshot()
    assert s.shards.active == () and s.shards.completed == 1 and s.shards.bytes_downloaded == 2


def test_json_round_trip_and_derived_fields_in_json() -> None:
    s = busy_board(FakeClock()).snapshot()
    doc = json.loads(s.to_json())
    assert doc["policy"]["staleness"] == 2 and doc["proofs"]["acceptance_rate"] == 0.5
    assert StatusSnapshot.from_json(s.to_json()) == s
    assert StatusSnapshot.from_json(s.to_json().decode()) == s


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_from_json_rejects_garbage_with_protocol_error_only(data: bytes) -> None:
    try:
        StatusSnapshot.from_json(data)
    except ProtocolError:
        pass


def test_from_json_rejects_wrong_types_and_oversize() -> None:
    doc = json.loads(StatusSnapshot().to_json())
    doc["rollouts"]["accepted"] = "many"
    with pytest.raises(ProtocolError):
        StatusSnapshot.from_json(json.dumps(doc))
    with pytest.raises(ProtocolError):
        StatusSnapshot.from_json(b" " * (5 * 1024 * 1024))


def test_concurrent_updates_lose_nothing_and_listeners_see_changes() -> None:
    b = StatusBoard()
    seen: list[int] = []
    unsubscribe = b.subscribe(lambda s: seen.append(s.seq))

    def work() -> None:
        for _ in range(500):
            b.rollouts_generated(1, tokens=2)
            b.verdict(True)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = b.snapshot()
    assert s.rollouts.generated == 2000 and s.rollouts.accepted == 2000 and s.throughput.tokens_total == 4000
    assert len(seen) == 4000
    unsubscribe()
    b.warn("after")
    assert len(seen) == 4000


def test_log_handler_forwards_warnings() -> None:
    import logging
    b = StatusBoard()
    log = logging.getLogger("intellect_node.test_board")
    h = BoardLogHandler(b)
    log.addHandler(h)
    try:
        log.info("quiet")
        log.warning("disk almost full: %d%%", 95)
    finally:
        log.removeHandler(h)
    assert [w.message for w in b.snapshot().warnings] == ["disk almost full: 95%"]


def test_degraded_reasons_restarts_and_age() -> None:
    clock = FakeClock()
    b = StatusBoard(clock=clock, monotonic=clock)
    b.set_state("running")
    b.refreshed()
    assert b.snapshot().state == "running" and b.snapshot().healthy
    b.set_degraded("libp2p", "libp2p restarting: the libp2p thread ended")
    b.set_degraded("task validator-loop", "task validator-loop restarting after: RuntimeError: boom")
    b.set_restarts("libp2p", 1)
    b.set_restarts("tasks", 2)
    s = b.snapshot()
    assert s.state == "degraded" and not s.healthy
    assert s.health.reasons == ("libp2p restarting: the libp2p thread ended",
                                "task validator-loop restarting after: RuntimeError: boom")
    assert s.health.restarts == {"libp2p": 1, "tasks": 2}
    doc = json.loads(s.to_json())
    assert doc["state"] == "degraded" and doc["healthy"] is False and doc["health"]["restarts"]["tasks"] == 2
    assert StatusSnapshot.from_json(s.to_json()) == s
    seq = b.snapshot().seq
    b.set_degraded("libp2p", "libp2p restarting: the libp2p thread ended")  # unchanged: no new version
    assert b.snapshot().seq == seq
    b.set_degraded("libp2p", "")
    b.set_degraded("task validator-loop", "")
    assert b.snapshot().state == "running" and b.snapshot().health.reasons == ()
    # the status loop stopped refreshing: the numbers age, and a viewer calls them stale
    clock.t += 7
    s = b.snapshot()
    assert s.age_s == 7 and s.freshness(s.ts) == "stale (7 s)" and json.loads(s.to_json())["age_s"] == 7
    b.refreshed()
    assert b.snapshot().freshness(clock.t) == ""
    # a stopping node is not "degraded", whatever its reasons
    b.set_degraded("peers", "no peers for 31 s")
    b.set_state("stopping")
    assert b.snapshot().state == "stopping" and not b.snapshot().healthy
