"""``roles/auditor/evidence.py``: a record's admission evidence, heard rejections, drops and stale claims.

Pure checks on signed verdicts made here with real keys: an honest record passes; a forged, foreign,
short, rejecting, mismatched or stale piece of evidence fails with its reason; an accepted batch no record
names fails the first record past its deadline; a batch recorded stale while fresh fails.
"""

from __future__ import annotations

import msgspec
import pytest

from intellect_node.errors import ProtocolError
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import BatchVerdict, seal_verdict
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.steps import (
    DroppedBatch,
    StepBatch,
    StepRecord,
    StepSettings,
    check_record,
)
from intellect_node.roles.auditor.evidence import (
    REJECT_MARGIN_S,
    AdmissionCheck,
    Admitted,
    RunRules,
    check_evidence,
)

V1, V2, MALLORY, WORKER, OTHER = (SigningKey(bytes([i]) * 32) for i in range(1, 6))
RULES = RunRules("run", frozenset({V1.peer_id, V2.peer_id}), quorum=2, async_level=1)
SETTINGS = StepSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, group_size=2, clip_eps_low=0.2,
                        clip_eps_high=0.2, neg_ratio_cap=1.0, max_grad_norm=1.0, token_budget=100,
                        kl_coef=0.0, entropy_coef=0.0, scale_by_std=True, temperature=1.0, micro_tokens=None,
                        compute_dtype=None)
H0, H1 = cid_of(b"weights 0"), cid_of(b"weights 1")


def _verdict(cid: str, *, accepted: bool = True, version: int = 0, worker: SigningKey = WORKER,
             time_ms: int = 1_000_000_000_000, run_id: str = "run", reason: str = "reward") -> BatchVerdict:
    if accepted:
        return BatchVerdict(run_id=run_id, batch_cid=cid, worker=worker.peer_id, policy_version=version,
                            accepted=True, n_accepted=4, n_rejected=0, time_ms=time_ms)
    return BatchVerdict(run_id=run_id, batch_cid=cid, worker=worker.peer_id, policy_version=version,
                        accepted=False, n_accepted=0, n_rejected=4, reason=reason, time_ms=time_ms)


def _batch(cid: str, *evidence: bytes) -> StepBatch:
    return StepBatch(cid=cid, worker=WORKER.peer_id, groups=2, trained=[0], evidence=list(evidence))


def _record(seq: int, base: int, batches: list[StepBatch], stale: list[StepBatch] | None = None,
            dropped: list[DroppedBatch] | None = None) -> StepRecord:
    return check_record(StepRecord(run_id="run", seq=seq, step=seq, base_version=base, base_hash=H0,
                                   version=base + 1, checkpoint_hash=H1, batches=batches, settings=SETTINGS,
                                   stale=stale or [], dropped=dropped or []))


def _accepted(cid: str, version: int = 0) -> StepBatch:
    return _batch(cid, seal_verdict(V1, _verdict(cid, version=version)),
                  seal_verdict(V2, _verdict(cid, version=version, time_ms=1_000_000_000_500)))


OUTSIDE = SigningKey(bytes([6]) * 32)  # a third run validator, not in the quorum that admitted the batch
RULES3 = RunRules("run", frozenset({V1.peer_id, V2.peer_id, OUTSIDE.peer_id}), quorum=2, async_level=1)


def _accepted3(cid: str, time_ms: int = 1_000_000_000_000) -> StepBatch:
    """Admitted by V1 and V2 of three validators."""
    return _batch(cid, seal_verdict(V1, _verdict(cid, time_ms=time_ms)),
                  seal_verdict(V2, _verdict(cid, time_ms=time_ms + 500)))


def test_honest_evidence_admits() -> None:
    got = check_evidence(_accepted(cid_of(b"a")), base_version=1, rules=RULES)
    assert got == Admitted(version=0, quorum_ms=1_000_000_000_500,
                           signers=frozenset({V1.peer_id, V2.peer_id}))


@pytest.mark.parametrize("case, why", [
    ("none", "carries no evidence"),
    ("short", "accepted by 1 distinct validator(s)"),
    ("twice", "accepted by 1 distinct validator(s)"),
    ("outsider", "not one of the run's validators"),
    ("rejected", "was rejected by validator"),
    ("other_batch", "a verdict on another batch"),
    ("other_worker", "a verdict on another batch"),
    ("other_run", "a verdict on another batch"),
    ("versions", "name policy versions"),
    ("stale", "stale at base v2"),
    ("tampered", "not a valid signed verdict"),
    ("garbage", "not a valid signed verdict"),
])
def test_bad_evidence_fails_with_its_reason(case: str, why: str) -> None:
    cid = cid_of(b"b")
    one = seal_verdict(V1, _verdict(cid))
    two = seal_verdict(V2, _verdict(cid))
    evidence = {
        "none": [],
        "short": [one],
        "twice": [one, seal_verdict(V1, _verdict(cid, time_ms=1_000_000_000_001))],
        "outsider": [one, seal_verdict(MALLORY, _verdict(cid))],
        "rejected": [one, seal_verdict(V2, _verdict(cid, accepted=False))],
        "other_batch": [one, seal_verdict(V2, _verdict(cid_of(b"c")))],
        "other_worker": [one, seal_verdict(V2, _verdict(cid, worker=OTHER))],
        "other_run": [one, seal_verdict(V2, _verdict(cid, run_id="other"))],
        "versions": [one, seal_verdict(V2, _verdict(cid, version=1))],
        "stale": [one, two],
        "tampered": [one, two.replace(b"run", b"ruX", 1)],
        "garbage": [one, b"\x00" * 40],
    }[case]
    got = check_evidence(_batch(cid, *evidence), base_version=2 if case == "stale" else 0, rules=RULES)
    assert isinstance(got, str) and why in got, got


def test_evidence_is_bounded_in_the_record() -> None:
    cid = cid_of(b"d")
    with pytest.raises(ProtocolError, match="evidence envelopes"):
        _record(1, 0, [_batch(cid, b"x" * 5000)])
    with pytest.raises(ProtocolError, match="no trained groups and no evidence"):
        _record(1, 0, [], stale=[StepBatch(cid=cid, worker=WORKER.peer_id, groups=2,
                                           evidence=[b"x"])])
    with pytest.raises(ProtocolError, match="reason of"):
        _record(1, 0, [], dropped=[DroppedBatch(cid=cid, worker=WORKER.peer_id, reason="whim")])


T0 = 1_000_000_000_000  # the verdicts' dates (unix ms); what the auditor heard when is on its own clock


def test_rejection_heard_well_before_the_quorum_fails() -> None:
    cid = cid_of(b"e")
    check = AdmissionCheck(RULES3)
    check.heard(_verdict(cid, accepted=False, time_ms=T0), OUTSIDE.peer_id, 0, at=100.0)
    check.heard(_verdict(cid, time_ms=T0 + 90_000), V1.peer_id, 0, at=100.0 + REJECT_MARGIN_S + 1)
    why = check.check(_record(1, 0, [_accepted3(cid)]))
    assert f"rejected by validator {OUTSIDE.peer_id} (reward)" in why and "the step trained on it" in why


def test_rejection_heard_after_the_quorum_is_a_dispute() -> None:
    cid = cid_of(b"f")
    check = AdmissionCheck(RULES3)
    check.heard(_verdict(cid, time_ms=T0), V1.peer_id, 0, at=10.0)
    check.heard(_verdict(cid, accepted=False, time_ms=T0 + 400), OUTSIDE.peer_id, 0, at=11.0)
    check.heard(_verdict(cid, accepted=False, time_ms=1, reason="stale"), V2.peer_id, 0, at=1.0)  # abstains
    assert check.check(_record(1, 0, [_accepted3(cid)])) == ""
    assert check.disputed == 1


def test_a_backdated_rejection_published_late_frames_no_one() -> None:
    """A validator outside the quorum dates its rejection minutes before the quorum (a clock behind, or a
    lie) and publishes it after: the trainer could not have had it first."""
    cid = cid_of(b"framed")
    check = AdmissionCheck(RULES3)
    for key, at in ((V1, 5.0), (V2, 6.0)):
        check.heard(_verdict(cid, time_ms=T0 + 240_000), key.peer_id, 0, at=at)
    check.heard(_verdict(cid, accepted=False, time_ms=T0), OUTSIDE.peer_id, 0, at=7.0)  # 4 min "earlier"
    assert check.check(_record(1, 0, [_accepted3(cid, time_ms=T0 + 240_000)])) == ""
    assert check.disputed == 1


def test_clock_skew_between_validators_fails_no_one() -> None:
    """Honest validators whose clocks differ by minutes (within what gossip accepts) and gossip that
    delivers in seconds: the rejection came after the quorum, whatever the dates say."""
    cid = cid_of(b"skew")
    check = AdmissionCheck(RULES3)
    check.heard(_verdict(cid, time_ms=T0 + 200_000), V1.peer_id, 0, at=50.0)  # a clock 200 s ahead
    check.heard(_verdict(cid, time_ms=T0 + 200_500), V2.peer_id, 0, at=50.5)
    check.heard(_verdict(cid, accepted=False, time_ms=T0), OUTSIDE.peer_id, 0, at=52.0)
    assert check.check(_record(1, 0, [_accepted3(cid, time_ms=T0 + 200_000)])) == ""


def test_rejection_shortly_before_the_quorum_is_a_dispute() -> None:
    """Heard a few seconds before the quorum's acceptances: the trainer may well have had the quorum
    first (gossip reaches nodes in different orders), so an honest one is not failed."""
    cid = cid_of(b"close")
    check = AdmissionCheck(RULES3)
    check.heard(_verdict(cid, accepted=False, time_ms=T0 - 120_000), OUTSIDE.peer_id, 0, at=20.0)
    check.heard(_verdict(cid, time_ms=T0), V1.peer_id, 0, at=20.0 + REJECT_MARGIN_S - 1)
    assert check.check(_record(1, 0, [_accepted3(cid)])) == ""


def test_rejection_with_the_quorum_never_heard_is_a_dispute() -> None:
    cid = cid_of(b"unheard")
    check = AdmissionCheck(RULES3)
    check.heard(_verdict(cid, accepted=False, time_ms=T0 - 600_000), OUTSIDE.peer_id, 0, at=1.0)
    check.heard(_verdict(cid, time_ms=T0), OUTSIDE.peer_id, 0, at=1000.0)  # not one of the record's quorum
    assert check.check(_record(1, 0, [_accepted3(cid)])) == ""


def _heard_accepted(check: AdmissionCheck, cid: str, version: int, newest: int) -> None:
    for key in (V1, V2):
        check.heard(_verdict(cid, version=version), key.peer_id, newest, at=0.0)


def test_accepted_batch_never_named_fails_at_its_deadline() -> None:
    lost, kept = cid_of(b"lost"), cid_of(b"kept")
    check = AdmissionCheck(RULES)
    _heard_accepted(check, lost, 0, 0)
    _heard_accepted(check, kept, 0, 0)
    other = [cid_of(bytes([i])) for i in range(3)]
    # deadline: max(0 + async_level 1 + 1, 0 + 2) = base version 2
    assert check.check(_record(1, 0, [_accepted(other[0])])) == ""
    assert check.check(_record(2, 1, [_accepted(other[1], 1)])) == ""
    why = check.check(_record(3, 2, [_accepted(other[2], 2)],
                              stale=[StepBatch(cid=kept, worker=WORKER.peer_id, groups=2)]))
    assert f"accepted batch {lost} of worker {WORKER.peer_id}" in why and "never trained" in why
    assert kept not in why


def test_dropped_with_a_reason_is_named() -> None:
    cid = cid_of(b"refused")
    check = AdmissionCheck(RULES)
    _heard_accepted(check, cid, 0, 0)
    dropped = [DroppedBatch(cid=cid, worker=WORKER.peer_id, reason="duplicate")]
    assert check.check(_record(1, 0, [_accepted(cid_of(b"x"))], dropped=dropped)) == ""
    assert check.check(_record(2, 5, [_accepted(cid_of(b"y"), 5)])) == ""


def test_a_quorum_heard_late_moves_the_deadline() -> None:
    cid = cid_of(b"late")
    check = AdmissionCheck(RULES)
    _heard_accepted(check, cid, 0, newest=4)  # heard when the trainer was at v4 already: deadline 6
    assert check.check(_record(1, 5, [_accepted(cid_of(b"z"), 5)])) == ""
    assert "never trained" in check.check(_record(2, 6, [_accepted(cid_of(b"w"), 6)]))


@pytest.mark.parametrize("dropped", [False, True])
def test_fresh_batch_recorded_stale_fails(dropped: bool) -> None:
    cid = cid_of(b"fresh")
    check = AdmissionCheck(RULES)
    _heard_accepted(check, cid, 1, 1)
    ref = StepBatch(cid=cid, worker=WORKER.peer_id, groups=2)
    rec = (_record(1, 2, [_accepted(cid_of(b"v"), 2)],
                   dropped=[DroppedBatch(cid=cid, worker=WORKER.peer_id, reason="stale")]) if dropped
           else _record(1, 2, [_accepted(cid_of(b"v"), 2)], stale=[ref]))
    why = check.check(rec)
    assert "recorded stale at base v2, but its rollouts of v1 were fresh" in why
    honest = AdmissionCheck(RULES)
    _heard_accepted(honest, cid, 0, 0)  # of v0: stale at base 2 (async_level 1)
    assert honest.check(msgspec.structs.replace(rec, seq=1)) == ""
