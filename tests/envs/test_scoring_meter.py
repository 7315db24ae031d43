"""The scoring meter (``envs/sandbox.Meter``): what one batch's answers may cost a scoring pool, and a
pool closed under a call in flight (issue 32 item 1)."""

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
