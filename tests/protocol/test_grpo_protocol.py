"""RL gossip messages: round trips, strict decoding of hostile bytes, and signatures (honest vs mallory)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import (
    BatchVerdict,
    RolloutNotice,
    notice_validator,
    seal_notice,
    seal_verdict,
    verdict_validator,
)
from intellect_node.protocol.signing import Envelope, SigningKey

WORKER, VALIDATOR, MALLORY = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
CID = cid_of(b"batch")


def _notice(**kw: Any) -> RolloutNotice:
    base: dict[str, Any] = dict(run_id="r1", batch_cid=CID, policy_version=3, n_rollouts=16, batch_bytes=1000)
    base.update(kw)
    return RolloutNotice(**base)


def _verdict(**kw: Any) -> BatchVerdict:
    base: dict[str, Any]
    base = dict(run_id="r1", batch_cid=CID, worker=WORKER.peer_id, policy_version=3, accepted=True,
                n_accepted=16, n_rejected=0, time_ms=1_700_000_000_000)
    base.update(kw)
    return BatchVerdict(**base)


def test_notice_round_trip_and_publisher_binding() -> None:
    validate = notice_validator("r1")
    raw = seal_notice(WORKER, _notice())
    assert validate(raw, WORKER.peer_id) == (_notice(), WORKER.peer_id)
    with pytest.raises(ProtocolError, match="another peer"):  # mallory re-publishes the worker's notice
        validate(raw, MALLORY.peer_id)
    with pytest.raises(ProtocolError, match="run"):
        notice_validator("r2")(raw, WORKER.peer_id)
    # A forged signature: mallory's signature over the worker's name.
    env = codec.decode(raw, Envelope, max_size=4096)
    forged = codec.encode(msgspec.structs.replace(env, signature=MALLORY.sign_bytes(env.domain, env.payload)))
    with pytest.raises(ProtocolError, match="signature"):
        validate(forged, WORKER.peer_id)


def _sealed_at() -> int:
    return _verdict().time_ms


def test_verdicts_only_from_trusted_validators() -> None:
    raw = seal_verdict(VALIDATOR, _verdict())
    trusted = frozenset({VALIDATOR.peer_id})
    assert verdict_validator("r1", trusted, now=_sealed_at)(raw, VALIDATOR.peer_id)[0] == _verdict()
    mallory = seal_verdict(MALLORY, _verdict())
    with pytest.raises(ProtocolError, match="not one of the run's validators"):
        verdict_validator("r1", trusted, now=_sealed_at)(mallory, MALLORY.peer_id)
    # Gossip forwarding keeps the origin; a verdict published again under another origin is refused
    # (signer == origin, so the blame for a bad one lands on its real publisher).
    with pytest.raises(ProtocolError, match="another peer than its publisher"):
        verdict_validator("r1", trusted, now=_sealed_at)(raw, MALLORY.peer_id)


@pytest.mark.parametrize("bad", [
    dict(accepted=True, n_rejected=1), dict(accepted=False, n_accepted=16, n_rejected=0),
    dict(accepted=True, reason="reward"), dict(accepted=True, ban=True), dict(worker="nope"),
    dict(batch_cid="bafy-not-a-cid"), dict(policy_version=-1), dict(reason="x" * 65),
    dict(accepted=False, n_accepted=0, n_rejected=16, reason="Bad Reason"),
    dict(accepted=False, n_accepted=0, n_rejected=16, reason="seed", detail="a\x1b[2Jb"),
    dict(time_ms=0), dict(time_ms=1 << 60),
])
def test_inconsistent_verdicts_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        seal_verdict(VALIDATOR, _verdict(**bad))


@pytest.mark.parametrize("bad", [dict(n_rollouts=0), dict(batch_bytes=0), dict(batch_bytes=1 << 40),
                                 dict(run_id="Bad Run"), dict(n_rollouts=5000)])
def test_inconsistent_notices_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        seal_notice(WORKER, _notice(**bad))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    for validate in (notice_validator("r1"), verdict_validator("r1", None)):
        with pytest.raises(ProtocolError):
            validate(data, WORKER.peer_id)
