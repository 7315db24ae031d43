"""Held-out evaluation results: round trips, the evaluator's signature (honest and mallory), figures and
digest that must follow from the rewards, the time window, random bytes."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.protocol.evals import (
    EVAL_DOMAIN,
    MAX_EVAL_BYTES,
    MAX_PROBLEMS,
    EvalResult,
    make_result,
    open_result,
    outcomes_digest,
    result_validator,
    seal_result,
)
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey

EVALUATOR = SigningKey(bytes(range(32)))
MALLORY = SigningKey(bytes(range(1, 33)))
POLICY = cid_of(b"v4")
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.01, 0.0, 1.0, 0.25]


def _result(rewards: list[float] = REWARDS) -> EvalResult:
    return make_result(run_id="r1", version=4, policy=POLICY, seed=7, rewards=rewards)


def test_round_trip_figures_and_signer() -> None:
    raw = seal_result(EVALUATOR, _result(), now_ms=1_800_000_000_000)
    r, signer = open_result(raw, run_id="r1")
    assert signer == EVALUATOR.peer_id and r == msgspec.structs.replace(_result(), time_ms=1_800_000_000_000)
    assert r.n == 8 and r.pass_rate == 3 / 8 and r.mean_reward == sum(REWARDS) / 8
    assert r.outcomes == outcomes_digest(REWARDS) != outcomes_digest(REWARDS[::-1])
    with pytest.raises(ProtocolError, match="this node is in"):
        open_result(raw, run_id="r2")


def test_the_largest_result_fits() -> None:
    raw = seal_result(EVALUATOR, _result([0.123456789] * MAX_PROBLEMS))
    assert len(raw) <= MAX_EVAL_BYTES
    with pytest.raises(ProtocolError, match="1..512"):
        seal_result(EVALUATOR, _result([1.0] * (MAX_PROBLEMS + 1)))


@pytest.mark.parametrize("change, why", [
    (dict(pass_rate=0.875), "not its rewards'"),
    (dict(mean_reward=0.9), "not its rewards'"),
    (dict(outcomes=outcomes_digest([1.0] * 8)), "digest is not its rewards'"),
    (dict(rewards=[1.0] * 8), "digest is not its rewards'"),
    (dict(rewards=[1.5] + REWARDS[1:]), "outside"),
    (dict(rewards=[float("nan")] + REWARDS[1:]), "outside"),
    (dict(policy="not a cid"), "not a CIDv1"),
])
def test_a_result_whose_figures_do_not_follow_from_its_rewards_is_refused(change: dict[str, object],
                                                                           why: str) -> None:
    forged = msgspec.structs.replace(_result(), time_ms=int(time.time() * 1000), **change)
    with pytest.raises(ProtocolError, match=why):
        seal_result(EVALUATOR, forged)  # the honest sealer refuses to sign it
    raw = EVALUATOR.seal(EVAL_DOMAIN, forged)  # a forger signs it anyway
    with pytest.raises(ProtocolError, match=why):
        open_result(raw, run_id="r1")


def test_the_gossip_validator_wants_the_signer_as_publisher_and_ignores_what_is_out_of_its_window() -> None:
    validate = result_validator("r1")
    fresh = seal_result(EVALUATOR, _result())
    assert validate(fresh, EVALUATOR.peer_id)[1] == EVALUATOR.peer_id
    with pytest.raises(ProtocolError, match="another peer than its publisher"):
        validate(fresh, MALLORY.peer_id)
    now = int(time.time() * 1000)
    for stamp in (now - 301_000, now + 61_000):  # a replay, a clock far ahead: ignored, nobody blamed
        with pytest.raises(MessageIgnored):
            validate(seal_result(EVALUATOR, _result(), now_ms=stamp), EVALUATOR.peer_id)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        open_result(data, run_id="r1")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=MAX_PROBLEMS))
def test_any_rewards_round_trip(rewards: list[float]) -> None:
    raw = seal_result(EVALUATOR, _result(rewards))
    r, _ = open_result(raw, run_id="r1")
    assert r.rewards == rewards and r.outcomes == outcomes_digest(rewards)
