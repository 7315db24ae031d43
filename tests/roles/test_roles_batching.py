"""The trainer's admission rules (``roles/trainer/admission.py``), driven directly: which verdicts take a
batch in (quorum, closed runs, bans, staleness, each batch once) and which queued batches form a step."""

from __future__ import annotations

from typing import Any

from intellect_node.protocol.rl import BatchVerdict
from intellect_node.roles.trainer.admission import Admission
from intellect_node.roles.trainer.batching import Accepted, fresh_floor, vote_key


def _verdict(cid: str, worker: str = "w1", *, accepted: bool = True, version: int = 0) -> BatchVerdict:
    return BatchVerdict(run_id="r", batch_cid=cid, worker=worker, policy_version=version, accepted=accepted,
                        n_accepted=8 if accepted else 0, n_rejected=0 if accepted else 8)


def _acc(cid: str, version: int, seq: int, groups: int = 1, worker: str = "w1") -> Accepted:
    return Accepted(cid, worker, version, [[] for _ in range(groups)], seq)


def _admission(**kw: Any) -> Admission:
    args: dict[str, Any] = {"quorum": 1, "async_level": 2, "groups_per_step": 4}
    args.update(kw)
    return Admission(**args)


def _decide(adm: Admission, v: BatchVerdict, validator: str = "val1", *, version: int = 0,
            consumed: bool = False, banned: bool = False) -> str:
    return adm.decide(v, validator, version=version, consumed=consumed, banned=banned)


def test_quorum_and_a_rejection_that_comes_first() -> None:
    adm = _admission(quorum=2)
    assert _decide(adm, _verdict("b1")) == "wait"
    assert _decide(adm, _verdict("b1")) == "wait"  # the same validator twice is one vote
    assert _decide(adm, _verdict("b1"), "val2") == "admit"
    assert _decide(adm, _verdict("b1"), "val3") == "ignore"  # decided: later verdicts change nothing
    assert _decide(adm, _verdict("b2")) == "wait"
    assert _decide(adm, _verdict("b2", accepted=False), "val2") == "refuse"
    assert _decide(adm, _verdict("b2"), "val3") == "ignore"
    assert len(adm.tally) == 1  # b1's votes stay until its admission is reported


def test_decisions_are_per_worker_and_batch() -> None:
    """A notice naming another worker's blob gets a verdict of its own; it cannot decide that worker's
    batch."""
    adm = _admission()
    assert _decide(adm, _verdict("b1", "mallory", accepted=False)) == "refuse"
    assert _decide(adm, _verdict("b1", "w1")) == "admit"
    assert vote_key("w1", "b1") in adm.known and vote_key("mallory", "b1") in adm.known


def test_closed_run_consumed_and_banned() -> None:
    adm = _admission(allowed=frozenset({"w1"}))
    assert _decide(adm, _verdict("b1", "outsider")) == "not_allowed"
    assert _decide(adm, _verdict("b1", "outsider"), "val2") == "ignore"  # counted once
    assert _decide(adm, _verdict("b2"), consumed=True) == "ignore"  # in a checkpoint already
    # A banned worker's batch is not decided: should the ban be lifted by a restart, it can come back.
    assert _decide(adm, _verdict("b3"), banned=True) == "banned"
    assert vote_key("w1", "b3") not in adm.known
    assert _decide(adm, _verdict("b3"), "val2") == "admit"


def test_stale_verdicts_are_refused_at_the_floor() -> None:
    assert fresh_floor(5, 2) == 3
    adm = _admission()
    assert _decide(adm, _verdict("old", version=2), version=5) == "stale"
    assert _decide(adm, _verdict("old", version=2), "val2", version=5) == "ignore"
    assert _decide(adm, _verdict("edge", version=3), version=5) == "admit"
    assert len(adm.tally) == 1  # the stale one's votes are gone, the admitted one's wait for add()


def test_a_failed_admission_can_come_back_and_a_duplicate_cannot() -> None:
    adm = _admission(quorum=2)
    assert _decide(adm, _verdict("b1")) == "wait"
    assert _decide(adm, _verdict("b1"), "val2") == "admit"
    adm.failed("w1", "b1")  # its blob could not be fetched
    # The votes were kept: the next acceptance admits it again.
    assert _decide(adm, _verdict("b1"), "val3") == "admit"
    adm.refused("w1", "b1")  # it held rollouts admitted before
    assert _decide(adm, _verdict("b1"), "val4") == "ignore"
    assert len(adm.tally) == 0


def test_take_waits_for_a_steps_worth_then_takes_newest_first() -> None:
    adm = _admission(groups_per_step=4)
    adm.add(_acc("a", version=3, seq=1, groups=2))
    adm.add(_acc("b", version=4, seq=2, groups=1))
    assert adm.take(version=4) is None  # 3 fresh groups of 4
    assert adm.queued_groups() == 3
    adm.add(_acc("c", version=4, seq=3, groups=2))
    adm.add(_acc("d", version=1, seq=4, groups=2))  # below fresh_floor(4, 2) == 2
    adm.add(_acc("e", version=2, seq=5, groups=2))
    step = adm.take(version=4)
    assert step is not None
    # Newest policy first, then arrival order, whole batches until the step's groups are there.
    assert [a.cid for a in step.taken] == ["b", "c", "a"]
    assert [a.cid for a in step.stale] == ["d"]
    assert [a.cid for a in adm.queue] == ["e"]


def test_take_leaves_older_fresh_batches_queued_and_drops_stale_ones() -> None:
    adm = _admission(groups_per_step=2)
    for i, version in enumerate([1, 5, 5, 2]):
        adm.add(_acc(f"b{i}", version=version, seq=i, groups=1))
    step = adm.take(version=5)
    assert step is not None
    assert [a.cid for a in step.taken] == ["b1", "b2"]
    assert [a.cid for a in step.stale] == ["b0", "b3"]  # below fresh_floor(5, 2) == 3
    assert not adm.queue
    adm.add(_acc("late", version=4, seq=9, groups=1))
    adm.add(_acc("new", version=6, seq=10, groups=1))
    adm.add(_acc("newer", version=6, seq=11, groups=1))
    step = adm.take(version=6)
    assert step is not None and [a.cid for a in step.taken] == ["new", "newer"] and not step.stale
    assert [a.cid for a in adm.queue] == ["late"]  # still fresh: used if nothing newer comes in time


def test_a_journaled_step_takes_the_same_batches_in_the_same_order() -> None:
    """Replay after a restart (``roles/trainer/replay.py``): the step's batches by name, in the journal's
    order, whatever ``take`` would choose now; nothing taken when one of them is missing."""
    adm = _admission(groups_per_step=2)
    for a in (_acc("old", 0, 1), _acc("b", 1, 2), _acc("a", 1, 3), _acc("stale", 0, 4)):
        adm.add(a)
    assert adm.take_named(["a", "missing"], []) is None
    assert [a.cid for a in adm.queue] == ["old", "b", "a", "stale"]  # untouched
    got = adm.take_named(["a", "old"], ["stale"])
    assert got is not None
    assert [a.cid for a in got.taken] == ["a", "old"] and [a.cid for a in got.stale] == ["stale"]
    assert [a.cid for a in adm.queue] == ["b"]
