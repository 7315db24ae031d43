"""The scoring meter (``envs/sandbox.Meter``): what one batch's answers may cost a scoring pool, and a
pool closed under a call in flight."""

from __future__ import annotations

import threading

import pytest

from intellect_node.envs.sandbox import Lane, Meter, ScoringFailed, ScoringPool, run_checker, scoring_in
from tests.support.wait import wait_for

SLOW = "$\\boxed{9^{9^{9^{9}}}}$"


def test_the_allowed_timeouts_stay_timeouts_and_the_next_one_spends_the_meter() -> None:
    meter = Meter(seconds=100.0, timeouts=1)
    assert meter.limit(5.0) == 5.0
    meter.charge(5.0, timed_out=True)  # within the allowance: the caller reports a timeout
    assert not meter.spent
    with pytest.raises(ScoringFailed) as exc:
        meter.charge(5.0, timed_out=True)
    assert exc.value.reason == "budget" and "2 answers ran past the time limit, at most 1" in meter.spent
    with pytest.raises(ScoringFailed, match="budget"):
        meter.limit(5.0)  # nothing more is scored
    assert (meter.calls, meter.timed_out, meter.used_s) == (2, 2, 10.0)


def test_scoring_seconds_bound_the_last_call_and_then_every_call() -> None:
    meter = Meter(seconds=3.0, timeouts=0)
    meter.charge(1.0)
    assert meter.limit(5.0) == 2.0  # what is left, not the whole time limit
    with pytest.raises(ScoringFailed, match="budget"):
        meter.charge(2.0, timed_out=False, cut=True)  # cut short by the meter: not the answer's timeout
    assert meter.timed_out == 0 and "3.0 s of scoring used of 3.0 s" in meter.spent
    fast = Meter(seconds=1.0, timeouts=0)
    fast.charge(1.5)  # a call that finished past the budget keeps its result ...
    with pytest.raises(ScoringFailed, match="budget"):
        fast.limit(5.0)  # ... and the next one is refused


def test_a_spent_meter_refuses_before_a_process_is_started() -> None:
    pool = ScoringPool(1)
    try:
        with scoring_in(Lane(pool, Meter(0.0, 0))), pytest.raises(ScoringFailed, match="budget"):
            run_checker("intellect_node.envs.mathcheck", "verify_in_child", "1", "1")
        assert pool.started == 0
    finally:
        pool.close()


def test_closing_a_pool_ends_a_call_in_flight_at_once() -> None:
    """A validator closing must not wait out a hostile answer's time limit in each of its threads."""
    pool = ScoringPool(1)
    got: list[str] = []

    def score() -> None:
        try:
            pool.call("intellect_node.envs.mathcheck", "verify_in_child", SLOW, "5", timeout_s=600.0,
                      warm=("math_verify", "sympy"))
        except ScoringFailed as exc:
            got.append(exc.reason)

    t = threading.Thread(target=score)
    t.start()
    wait_for(lambda: pool.busy == 1, timeout=120)
    pool.close()
    t.join(timeout=60)
    assert not t.is_alive() and got == ["checker_error"] and pool.busy == 0


def test_a_crash_counts_against_the_allowance_it_shares_with_timeouts() -> None:
    meter = Meter(seconds=100.0, timeouts=1)
    meter.charge(0.5, crashed=True)  # within the allowance: the pool retries on a fresh process
    assert not meter.spent and meter.crashed == 1
    with pytest.raises(ScoringFailed, match="budget"):
        meter.charge(5.0, timed_out=True)  # one crash and one timeout: past an allowance of one
    assert "1 answers ran past the time limit and 1 crashed the scoring process" in meter.spent


def _score_slow(pool: ScoringPool, meter: Meter, got: list[str]) -> None:
    """Score an answer that takes far longer than any test waits, under ``meter``; the reason it failed
    with goes to ``got``."""
    try:
        pool.call("intellect_node.envs.mathcheck", "verify_in_child", SLOW, "5", timeout_s=600.0,
                  warm=("math_verify", "sympy"), meter=meter)
    except ScoringFailed as exc:
        got.append(exc.reason)


def _crash_busy_child(pool: ScoringPool) -> None:
    """The busy scoring process dies under its call, as one a hostile answer crashed would."""
    def scoring() -> bool:  # past the imports: the answer itself is being scored
        return pool.busy == 1 and "sympy" in next(iter(pool._busy)).imported

    wait_for(scoring, timeout=120, what="the call scores its answer in a process")
    next(iter(pool._busy)).proc.kill()


def test_an_answer_that_crashes_the_checker_past_the_allowance_gets_no_free_restart() -> None:
    """Before, a crash was retried on a fresh process whatever the meter said, and neither the crash nor
    the replacement's start was charged: an answer that kills its checker cost its sender nothing."""
    pool = ScoringPool(1)
    meter = Meter(seconds=100.0, timeouts=0)
    got: list[str] = []
    t = threading.Thread(target=_score_slow, args=(pool, meter, got))
    try:
        t.start()
        _crash_busy_child(pool)
        t.join(timeout=60)
        assert not t.is_alive() and got == ["budget"], got
        assert meter.crashed == 1 and "crashed the scoring process" in meter.spent
        assert pool.started == 1  # no replacement started for it
    finally:
        pool.close()
        t.join(timeout=60)


def test_a_crash_within_the_allowance_is_retried_on_the_batchs_time() -> None:
    pool = ScoringPool(1)
    meter = Meter(seconds=1000.0, timeouts=1)
    got: list[str] = []
    t = threading.Thread(target=_score_slow, args=(pool, meter, got))
    try:
        t.start()
        _crash_busy_child(pool)
        wait_for(lambda: pool.started == 2, timeout=120, what="the retry's process")
        _crash_busy_child(pool)  # the retried call crashes too: past the allowance of one
        t.join(timeout=60)
        assert not t.is_alive() and got == ["budget"], got
        assert meter.crashed == 2 and meter.calls == 2
    finally:
        pool.close()
        t.join(timeout=60)
