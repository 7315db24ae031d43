"""StatusBoard and StatusSnapshot: counters, bounded histories, JSON round trip, strict decoding; the
trainer's learning signal (step attempts with no learnable group, the warning) and recent completions."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.config.status import (
    COMPLETION_CHARS,
    FIRST_LEN,
    HISTORY_LEN,
    NO_SIGNAL_ATTEMPTS,
    NO_SIGNAL_WINDOW_S,
    PROMPT_CHARS,
    RECENT_COMPLETIONS,
    RECENT_LEN,
    BoardLogHandler,
    Completion,
    StatusBoard,
    StatusSnapshot,
    clean_text,
)
from intellect_node.errors import ProtocolError
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


HINT = "every reward 0: completions too short (rl.max_new_tokens 1, 100% reach it)"


def test_attempts_with_no_learnable_group_are_counted_by_cause_and_raise_the_warning() -> None:
    clock = FakeClock()
    b = StatusBoard(role="trainer", clock=clock, monotonic=clock)
    b.train_attempt(groups=8, filtered=3)  # trained: 5 learnable groups
    for i in range(NO_SIGNAL_ATTEMPTS - 1):
        clock.t += 1
        b.train_attempt(groups=8, filtered=8, cause="all_zero", hint=HINT)
        t = b.snapshot().training
        assert t.no_signal_streak == i + 1 and t.no_signal_warning == ""  # not yet: a few can be chance
    b.train_attempt(groups=4, filtered=4, cause="all_one", hint="every reward 1: too easy")
    t = b.snapshot().training
    assert (t.attempts, t.no_signal_attempts, t.no_signal_streak) == (NO_SIGNAL_ATTEMPTS + 1,
                                                                      NO_SIGNAL_ATTEMPTS, NO_SIGNAL_ATTEMPTS)
    assert t.no_signal_causes == {"all_zero": NO_SIGNAL_ATTEMPTS - 1, "all_one": 1}
    assert (t.groups_seen, t.groups_filtered, t.filtered_fraction) == (28, 23, 1.0)
    assert t.no_signal_warning == (f"no learnable group in the last {NO_SIGNAL_ATTEMPTS} step attempts: "
                                   "every reward 1: too easy")  # the newest attempt's hint
    assert t.no_signal_since == 1001.0
    b.train_step(1, reward_mean=0.5, pass_rate=0.5)  # the step's counters survive a trained step
    b.train_attempt(groups=8, filtered=2)
    t = b.snapshot().training
    assert t.no_signal_streak == 0 and t.no_signal_warning == "" and t.no_signal_since == 0.0
    assert t.filtered_fraction == 0.25 and t.no_signal_attempts == NO_SIGNAL_ATTEMPTS and t.step == 1
    with pytest.raises(ValueError, match="no-signal cause"):
        b.train_attempt(groups=1, filtered=1, cause="bored")


def test_a_slow_run_shows_the_warning_a_minute_after_its_first_unlearnable_attempt() -> None:
    clock = FakeClock()
    b = StatusBoard(role="trainer", clock=clock, monotonic=clock)
    b.train_attempt(groups=8, filtered=8, cause="all_zero", hint=HINT)  # the run's very first attempt
    assert b.snapshot().training.no_signal_warning == ""
    clock.t += NO_SIGNAL_WINDOW_S  # no other attempt since (a big model on a CPU): the minute is up
    assert b.snapshot().training.no_signal_warning == f"no learnable group in the last step attempt: {HINT}"


def test_recent_completions_are_bounded_cut_and_clean() -> None:
    clock = FakeClock()
    b = StatusBoard(clock=clock)
    hostile = "\x1b[2J\x1b]0;pwned\x07 think\r\nmore\x00\x9b" + "9" * 500 + " <answer>42</answer>"
    b.completions([Completion(ts=clock.t, problem_id="add3/7", prompt="What is 1 + 2?\n" + "x" * 300,
                              text=hostile, answer="42\x1b[31m", expected="3", reward=0.0)])
    c = b.snapshot().training.completions[0]
    assert c.text.endswith("<answer>42</answer>'"[:-1]) and c.text.startswith("…")
    assert len(c.text) == COMPLETION_CHARS and len(c.prompt) == PROMPT_CHARS
    for field_ in (c.text, c.prompt, c.answer or ""):
        assert not any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in field_), field_
    assert c.answer == "42[31m" and c.prompt.startswith("What is 1 + 2? xx")
    b.completions([Completion(ts=clock.t + i, problem_id=f"p{i}", prompt="", text=str(i), answer=None,
                              expected="", reward=1.0, reason="no_answer") for i in range(20)])
    shown = b.snapshot().training.completions
    assert [x.text for x in shown] == [str(i) for i in range(20 - RECENT_COMPLETIONS, 20)]


def test_clean_text_keeps_one_line_and_cuts_where_asked() -> None:
    assert clean_text("a\tb\n\nc  d", 50) == "a b c d"
    assert clean_text("abcdef", 4) == "abc…" and clean_text("abcdef", 4, keep="tail") == "…def"
    assert clean_text("\x1b[0m\u200bok\x7f", 10) == "[0m\u200bok"  # only control characters go


def test_learning_signal_and_completions_round_trip_through_json() -> None:
    clock = FakeClock()
    b = busy_board(clock)
    for _ in range(NO_SIGNAL_ATTEMPTS):
        b.train_attempt(groups=8, filtered=8, cause="all_zero", hint=HINT)
    b.completions([Completion(ts=clock.t, problem_id="add3/1", prompt="1+1", text="2 is it", answer=None,
                              expected="2", reward=0.0, reason="no_answer", policy_version=3, worker="W"),
                   Completion(ts=clock.t, problem_id="add3/2", prompt="1+2", text="3", answer="3",
                              expected="3", reward=1.0)])
    s = b.snapshot()
    assert s.training.no_signal_warning and len(s.training.completions) == 2
    back = StatusSnapshot.from_json(s.to_json())
    assert back == s and back.training.completions[0].answer is None
    doc = json.loads(s.to_json())
    assert doc["training"]["no_signal_causes"] == {"all_zero": NO_SIGNAL_ATTEMPTS}
    assert doc["training"]["completions"][1]["answer"] == "3"
    fresh = StatusSnapshot.from_json(StatusBoard().snapshot().to_json())
    assert fresh.training.filtered_fraction is None and fresh.training.completions == ()
