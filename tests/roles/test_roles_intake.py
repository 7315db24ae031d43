"""The validator's intake state machine (``roles/validator/intake.py``): budgets, queues, round-robin,
parked versions and new identities, driven step by step with an explicit clock."""

from __future__ import annotations

from typing import Callable

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import RolloutNotice
from intellect_node.roles.validator.intake import Intake, Limits, TokenBucket


def _n(i: int, version: int = 0, size: int = 1000) -> RolloutNotice:
    return RolloutNotice(run_id="r", batch_cid=cid_of(f"b{i}".encode()), policy_version=version, n_rollouts=8,
                         batch_bytes=size)


def _always(_v: int) -> bool:
    return True


def _slots(n: int) -> Callable[[str], bool]:
    """A job pool of ``n`` slots (never given back: each test step makes a new one)."""
    left = [n]

    def grant(_worker: str) -> bool:
        if left[0] <= 0:
            return False
        left[0] -= 1
        return True

    return grant


LIM = Limits(peer_queue=3, notices_per_s=1.0, notice_burst=4, bytes_per_s=1000.0, bytes_burst=10_000,
             new_per_s=0.5, new_burst=2, newcomer_wait=1, max_ahead=2, park_s=30.0)


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = TokenBucket(rate=2.0, burst=3.0)
    assert all(b.take(1, 0.0) for _ in range(3)) and not b.take(1, 0.0)
    assert b.wait_s(1, 0.0) == 0.5
    assert b.take(1, 0.5) and not b.take(1, 0.5)
    assert b.take(3, 100.0) and not b.take(1, 100.0)  # capped at the burst


def test_rate_queue_and_bytes_budgets_refuse_the_excess_without_a_strike() -> None:
    it = Intake(LIM, exempt=frozenset({"a"}))
    assert [it.offer("a", _n(i), 0.0, 0) for i in range(3)] == [None, None, None]
    full = it.offer("a", _n(3), 0.0, 0)  # 4th notice within the burst, but the queue holds 3
    assert full is not None and (full.reason, full.strike) == ("busy", False) and "waiting" in full.detail
    over = it.offer("a", _n(4), 0.0, 0)  # burst of 4 notices spent
    assert over is not None and over.reason == "flood" and "a minute" in over.detail
    # Bytes: one 10 kB notice empties the bucket; the next must wait 1 s per kB.
    it2 = Intake(LIM, exempt=frozenset({"b"}))
    assert it2.offer("b", _n(0, size=10_000), 0.0, 0) is None
    big = it2.offer("b", _n(1, size=2000), 1.0, 0)
    assert big is not None and "bytes" in big.detail
    assert it2.offer("b", _n(2, size=2000), 3.0, 0) is None
    assert it.refused == {"busy": 1, "flood": 1} and it2.refused == {"flood": 1}
    assert not any((full.strike, over.strike, big.strike))


def test_one_in_flight_per_peer_round_robin_across_peers() -> None:
    it = Intake(LIM, exempt=frozenset({"a", "b", "c"}))
    for i in range(3):
        it.offer("a", _n(i), 0.0, 0)
    it.offer("b", _n(10), 0.0, 0)
    it.offer("c", _n(20), 0.0, 0)
    first = it.take(0.0, _always, grant=_slots(8))
    assert [p.worker for p in first] == ["a", "b", "c"]  # one each, though a has three
    assert it.take(0.0, _always, grant=_slots(8)) == []  # all busy
    it.done("a")
    it.done("b")
    assert [p.worker for p in it.take(0.0, _always, grant=_slots(8))] == ["a"]  # b has nothing left
    # The pool bounds the jobs; the served peer goes to the back of the round.
    it.done("a")
    it.offer("b", _n(11), 0.0, 0)
    it.done("c")
    it.offer("c", _n(21), 0.0, 0)
    assert [p.worker for p in it.take(0.0, _always, grant=_slots(1))] == ["b"]


def test_future_versions_park_per_peer_and_far_ones_are_refused() -> None:
    it = Intake(LIM, exempt=frozenset({"a", "b"}))
    far = it.offer("a", _n(0, version=13), 0.0, 10)
    assert far is not None and (far.reason, far.strike) == ("future", True)
    assert it.offer("a", _n(1, version=11), 0.0, 10) is None  # within max_ahead: parks
    assert it.offer("b", _n(2, version=10), 0.0, 10) is None
    held = {10}
    got = it.take(1.0, lambda v: v in held, grant=_slots(8))
    assert [p.worker for p in got] == ["b"]  # a's parked notice does not hold b up
    assert it.status()["parked"] == 1 and it.next_event(1.0) == 30.0
    assert it.expired(20.0) == []
    held.add(11)  # the version arrives in time
    assert [p.notice.policy_version for p in it.take(20.0, lambda v: v in held, grant=_slots(8))] == [11]
    # A version that never comes expires after park_s and is handed back for a verdict.
    it.done("a")
    it.offer("a", _n(3, version=12), 21.0, 10)
    it.take(22.0, lambda v: v in held, grant=_slots(8))
    assert it.expired(51.0) == [] and len(it.expired(52.0)) == 1
    # Before any announcement nothing is "from the future".
    assert Intake(LIM, exempt=frozenset({"x"})).offer("x", _n(9, version=10 ** 6), 0.0, -1) is None


def test_new_identities_are_rate_limited_then_wait_then_are_refused() -> None:
    it = Intake(LIM)  # new_burst 2, then one every 2 s, one may wait
    assert it.offer("n1", _n(1), 0.0, 0) is None and it.offer("n2", _n(2), 0.0, 0) is None
    assert it.offer("n3", _n(3), 0.0, 0) is None  # waits
    refused = it.offer("n4", _n(4), 0.0, 0)
    assert refused is not None and (refused.reason, refused.strike) == ("newcomer_limit", False)
    assert [p.worker for p in it.take(0.0, _always, grant=_slots(8))] == ["n1", "n2"]
    assert it.status()["newcomers_waiting"] == 1 and it.next_event(0.0) == 2.0
    assert [p.worker for p in it.take(2.0, _always, grant=_slots(8))] == ["n3"]
    # Known peers are not new again; the allowlist's peers never are.
    it.done("n1")
    assert it.offer("n1", _n(5), 2.0, 0) is None
    assert [p.worker for p in it.take(2.0, _always, grant=_slots(8))] == ["n1"]
    assert Intake(LIM, exempt=frozenset({"w"})).offer("w", _n(6), 0.0, 0) is None


def test_forget_drops_a_banned_peers_queue() -> None:
    it = Intake(LIM, exempt=frozenset({"a"}))
    for i in range(3):
        it.offer("a", _n(i), 0.0, 0)
    assert it.forget("a") == 3 and it.queued() == 0 and it.take(0.0, _always, grant=_slots(8)) == []
