"""Audit verdicts: round trips, the auditor's signature (honest and mallory), consistency, random bytes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol.audits import AuditVerdict, open_verdict, seal_verdict
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey

AUDITOR = SigningKey(bytes(range(32)))
MALLORY = SigningKey(bytes(range(1, 33)))
H1, H2 = cid_of(b"v1"), cid_of(b"v2")


def _verdict(**kw: Any) -> AuditVerdict:
    base: dict[str, Any] = dict(run_id="r1", trainer="T", seq=3, version=2, outcome="fail", published=H1,
                                   expected=H2, reason="the replayed weights differ")
    base.update(kw)
    return AuditVerdict(**base)


def test_round_trip_and_signers() -> None:
    raw = seal_verdict(AUDITOR, _verdict(), now_ms=1_800_000_000_000)  # dated as it is sealed
    ours = frozenset({AUDITOR.peer_id})
    assert open_verdict(raw, run_id="r1", auditors=ours) == (_verdict(time_ms=1_800_000_000_000),
                                                               AUDITOR.peer_id)
    assert open_verdict(raw, run_id="r1", auditors=None)[1] == AUDITOR.peer_id
    with pytest.raises(ProtocolError, match="not one of the run's auditors"):
        open_verdict(seal_verdict(MALLORY, _verdict()), run_id="r1", auditors=frozenset({AUDITOR.peer_id}))
    with pytest.raises(ProtocolError, match="this node is in"):
        open_verdict(raw, run_id="r2", auditors=None)


def test_a_pass_names_the_published_hash() -> None:
    seal_verdict(AUDITOR, _verdict(outcome="pass", expected=H1))
    with pytest.raises(ProtocolError, match="a pass"):
        seal_verdict(AUDITOR, _verdict(outcome="pass"))
    with pytest.raises(ProtocolError, match="a pass"):
        seal_verdict(AUDITOR, _verdict(outcome="pass", expected=""))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        open_verdict(data, run_id="r1", auditors=None)
