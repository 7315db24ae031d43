"""The rollout record and batch codecs: round trips, hostile bytes, invariants, signatures."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rollout import (
    RolloutBatch,
    RolloutRecord,
    SamplingParams,
    check_record,
    decode_batch,
    decode_rollout,
    encode_batch,
    encode_rollout,
    sign_rollout,
    verify_rollout_signature,
)
from intellect_node.protocol.signing import SigningKey

KEY = SigningKey(bytes(range(32)))
OTHER = SigningKey(bytes(range(1, 33)))
CID = cid_of(b"checkpoint")

tokens = st.lists(st.integers(0, 127), min_size=1, max_size=80)


@st.composite
def records(draw: st.DrawFn) -> RolloutRecord:
    completion = draw(tokens)
    n = len(completion)
    return sign_rollout(RolloutRecord(
        run_id=draw(st.text(min_size=1, max_size=20)), rollout_id=draw(st.text(min_size=1, max_size=40)),
        task_id="add3", problem_id=f"add3/{draw(st.integers(0, 999_999))}", prompt_tokens=draw(tokens),
        completion_tokens=completion,
        logprobs=draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n)),
        sampling=SamplingParams(temperature=draw(st.floats(0.05, 2.0)), top_p=draw(st.floats(0.05, 1.0)),
                                max_new_tokens=n + draw(st.integers(0, 5)),
                                seed=draw(st.integers(0, 2**64 - 1))),
        policy_version=draw(st.integers(0, 2**40)), checkpoint_cid=CID, dtype="float32",
        reward=draw(st.floats(-1, 1)), proofs=[draw(st.binary(min_size=258, max_size=258))
                                               for _ in range(-(-n // 32))],
        worker=KEY.peer_id), KEY)


@settings(max_examples=60, deadline=None)
@given(records())
def test_record_round_trips_and_verifies(rec: RolloutRecord) -> None:
    raw = encode_rollout(rec)
    back = decode_rollout(raw)
    assert back == rec and encode_rollout(back) == raw
    verify_rollout_signature(back)


@settings(max_examples=30, deadline=None)
@given(st.lists(records(), min_size=1, max_size=4, unique_by=lambda r: r.rollout_id))
def test_batch_round_trips(recs: list[RolloutRecord]) -> None:
    recs = [sign_rollout(msgspec.structs.replace(r, run_id="run", policy_version=3), KEY) for r in recs]
    batch = RolloutBatch(run_id="run", policy_version=3, rollouts=recs)
    assert decode_batch(encode_batch(batch)) == batch


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_raise_only_protocol_error(raw: bytes) -> None:
    for decode in (decode_rollout, decode_batch):
        try:
            decode(raw)
        except ProtocolError:
            pass


@settings(max_examples=60, deadline=None)
@given(records(), st.data())
def test_mutated_bytes_raise_protocol_error_or_break_the_signature(rec: RolloutRecord,
                                                                    data: st.DataObject) -> None:
    raw = bytearray(encode_rollout(rec))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        back = decode_rollout(bytes(raw))
    except ProtocolError:
        return
    if back != rec:
        with pytest.raises(ProtocolError):
            verify_rollout_signature(back)


def _valid() -> RolloutRecord:
    return sign_rollout(RolloutRecord(
        run_id="r", rollout_id="x", task_id="add3", problem_id="add3/5", prompt_tokens=[1, 2],
        completion_tokens=[3, 4, 2], logprobs=[-0.1, -0.2, -0.3], sampling=SamplingParams(max_new_tokens=8),
        policy_version=0, checkpoint_cid=CID, dtype="float32", reward=0.0, proofs=[bytes(258)],
        worker=KEY.peer_id), KEY)


@pytest.mark.parametrize("change", [
    {"logprobs": [-0.1, -0.2]}, {"logprobs": [-0.1, 0.5, -0.3]}, {"completion_tokens": []},
    {"proofs": []}, {"proofs": [bytes(258)] * 2}, {"sampling": SamplingParams(temperature=0.0)},
    {"sampling": SamplingParams(top_p=1.5)}, {"sampling": SamplingParams(max_new_tokens=2)},
    {"checkpoint_cid": "not-a-cid"}, {"run_id": ""}, {"prompt_tokens": [1, -2]}, {"reward": float("nan")},
])
def test_invariants_are_enforced(change: dict[str, object]) -> None:
    bad = msgspec.structs.replace(_valid(), **change)
    with pytest.raises(ProtocolError):
        check_record(bad)
    with pytest.raises(ProtocolError):
        decode_rollout(codec.encode(bad))


def test_signature_binds_every_field_and_the_worker() -> None:
    rec = _valid()
    verify_rollout_signature(rec)
    with pytest.raises(ProtocolError):
        verify_rollout_signature(msgspec.structs.replace(rec, policy_version=1))
    with pytest.raises(ProtocolError):  # mallory signs but claims to be the honest worker
        verify_rollout_signature(msgspec.structs.replace(sign_rollout(rec, OTHER), worker=KEY.peer_id))
    with pytest.raises(ProtocolError):
        verify_rollout_signature(msgspec.structs.replace(rec, signature=bytes(64)))


def test_batch_rejects_mixed_runs_and_duplicates() -> None:
    rec = _valid()
    with pytest.raises(ProtocolError):
        decode_batch(encode_batch(RolloutBatch(run_id="other", policy_version=0, rollouts=[rec])))
    with pytest.raises(ProtocolError):
        decode_batch(encode_batch(RolloutBatch(run_id="r", policy_version=0, rollouts=[rec, rec])))
    with pytest.raises(ProtocolError):
        decode_batch(encode_batch(RolloutBatch(run_id="r", policy_version=0, rollouts=[])))
