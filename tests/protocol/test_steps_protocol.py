"""Step records: round trips, the trainer's signature (honest and mallory), consistency, limits and
random bytes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import Envelope, SigningKey
from intellect_node.protocol.steps import (
    MAX_STEP_BATCHES,
    STEP_DOMAIN,
    StepBatch,
    StepRecord,
    StepSettings,
    check_record,
    open_record,
    record_validator,
    seal_record,
)

TRAINER = SigningKey(bytes(range(32)))
MALLORY = SigningKey(bytes(range(1, 33)))
H0, H1 = cid_of(b"v0"), cid_of(b"v1")
SETTINGS = StepSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, group_size=4, clip_eps_low=0.2,
                        clip_eps_high=0.2, neg_ratio_cap=4.0, max_grad_norm=0.1, token_budget=64, kl_coef=0.0,
                        entropy_coef=0.0, scale_by_std=False, temperature=1.0, micro_tokens=16384,
                        compute_dtype=None)


def _record(**kw: Any) -> StepRecord:
    base: dict[str, Any]
    base = dict(run_id="r1", seq=1, step=1, base_version=0, base_hash=H0, version=1, checkpoint_hash=H1,
                batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2, trained=[0, 1]),
                         StepBatch(cid=cid_of(b"b2"), worker="w2", groups=2, trained=[1])],
                stale=[StepBatch(cid=cid_of(b"b3"), worker="w1", groups=2)], settings=SETTINGS)
    base.update(kw)
    return StepRecord(**base)


def test_round_trip_and_trainer_signature() -> None:
    rec = _record()
    raw = seal_record(TRAINER, rec)
    assert open_record(raw, run_id="r1", trainer=TRAINER.peer_id) == rec
    assert record_validator("r1", TRAINER.peer_id)(raw, "someone") == rec
    assert rec.trained


def test_no_signal_step_keeps_its_policy() -> None:
    rec = _record(version=0, checkpoint_hash=H0, no_signal="all_zero",
                  batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2)])
    assert not open_record(seal_record(TRAINER, rec), run_id="r1", trainer=TRAINER.peer_id).trained


def test_mallory_cannot_publish_records() -> None:
    raw = seal_record(MALLORY, _record())
    with pytest.raises(ProtocolError, match="not the run's trainer"):
        open_record(raw, run_id="r1", trainer=TRAINER.peer_id)


def test_tampered_record_and_other_run_refused() -> None:
    raw = seal_record(TRAINER, _record())
    env = codec.decode(raw, Envelope, max_size=1 << 20)
    other_lr = _record(settings=msgspec.structs.replace(SETTINGS, lr=2e-3))
    forged = codec.encode(msgspec.structs.replace(env, payload=codec.encode(other_lr)))
    with pytest.raises(ProtocolError, match="bad signature"):
        open_record(forged, run_id="r1", trainer=TRAINER.peer_id)
    with pytest.raises(ProtocolError, match="this node is in"):
        open_record(raw, run_id="r2", trainer=TRAINER.peer_id)
    other_domain = TRAINER.seal("intellect/policy/1", _record())
    with pytest.raises(ProtocolError, match="expected"):
        open_record(other_domain, run_id="r1", trainer=TRAINER.peer_id)
    assert STEP_DOMAIN == "intellect/step/1"


@pytest.mark.parametrize("kw, match", [
    (dict(version=2), "does not follow"),
    (dict(checkpoint_hash="not-a-cid"), "CID|cid"),
    (dict(batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2, trained=[2])]), "below its"),
    (dict(batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2, trained=[1, 0])]), "ascending"),
    (dict(batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2, trained=[0])],
          stale=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2)]), "named twice"),
    (dict(stale=[StepBatch(cid=cid_of(b"b3"), worker="w1", groups=2, trained=[0])]), "stale batch"),
    (dict(no_signal="all_zero"), "trains exactly when"),
    (dict(batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2)]), "trains exactly when"),
    (dict(version=0, no_signal="all_one", batches=[]), "keeps its base policy"),
    (dict(no_signal="whatever"), "no_signal"),
    (dict(settings=msgspec.structs.replace(SETTINGS, compute_dtype="int8")), "settings"),
    (dict(batches=[StepBatch(cid=cid_of(i.to_bytes(4, "big")), worker="w", groups=1, trained=[0])
                   for i in range(MAX_STEP_BATCHES + 1)]), "at most"),
])
def test_inconsistent_records_refused(kw: dict[str, object], match: str) -> None:
    rec = _record(**kw)
    with pytest.raises(ProtocolError, match=match):
        check_record(rec)
    with pytest.raises(ProtocolError):
        seal_record(TRAINER, rec)
    # and at a receiver, signed by the trainer all the same
    with pytest.raises(ProtocolError):
        open_record(TRAINER.seal(STEP_DOMAIN, rec), run_id="r1", trainer=TRAINER.peer_id)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        open_record(data, run_id="r1", trainer=TRAINER.peer_id)


def test_oversize_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        open_record(b"\x00" * (1 << 20), run_id="r1", trainer=TRAINER.peer_id)
