"""Audit verdicts (gossip topic ``/intellect/<run_id>/audits/1``): an auditor's word on one step record.

An auditor (``roles/auditor/``) replays the trainer's steps from their signed records
(``protocol/steps.py``) and signs one :class:`AuditVerdict` per record it audited: ``pass`` (the replay
made the published ``checkpoint_hash``), ``fail`` (it made ``expected``, or the record contradicts
itself or the run: ``reason``) or ``unavailable`` (the audit could not run: a batch missing, the start
not held). ``unavailable`` is never a pass.
"""

from __future__ import annotations

from typing import Callable, Literal

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.signing import SigningKey, open_envelope
from intellect_node.protocol.topics import validate_run_id

AUDIT_DOMAIN = "intellect/audit/1"
AUDIT_KIND = "audits"  # the topic kind: /intellect/<run_id>/audits/1
MAX_AUDIT_BYTES = 4096
MAX_REASON_LEN = 1024


class AuditVerdict(codec.Message, frozen=True):
    run_id: str
    trainer: str  # the peer ID whose record was audited
    seq: int
    version: int
    outcome: Literal["pass", "fail", "unavailable"]
    published: str  # the record's checkpoint hash
    expected: str = ""  # the hash the replay made ("" when it did not run)
    reason: str = ""


def check_verdict(v: AuditVerdict) -> AuditVerdict:
    validate_run_id(v.run_id)
    if not 0 < len(v.trainer) <= 128 or not 0 < v.seq < 1 << 62 or not 0 <= v.version < 1 << 62:
        raise ProtocolError("audit verdict: trainer, seq or version out of range")
    validate_cid(v.published)
    if v.expected:
        validate_cid(v.expected)
    if len(v.reason) > MAX_REASON_LEN:
        raise ProtocolError(f"audit reason of {len(v.reason)} characters, at most {MAX_REASON_LEN}")
    if v.outcome == "pass" and v.expected != v.published:
        raise ProtocolError("a pass names the published hash as the one replayed")
    return v


def seal_verdict(key: SigningKey, v: AuditVerdict) -> bytes:
    return key.seal(AUDIT_DOMAIN, check_verdict(v))


def open_verdict(data: bytes, *, run_id: str, auditors: frozenset[str] | None) -> tuple[AuditVerdict, str]:
    """Decode and verify a verdict for ``run_id``; ``auditors``: the signers accepted (None: any)."""
    v, signer = open_envelope(data, AUDIT_DOMAIN, AuditVerdict, max_size=MAX_AUDIT_BYTES)
    if auditors is not None and signer not in auditors:
        raise ProtocolError(f"audit verdict signed by {signer}, not one of the run's auditors")
    if v.run_id != run_id:
        raise ProtocolError(f"audit verdict for run {v.run_id[:128]!r}, this node is in {run_id!r}")
    return check_verdict(v), signer


def verdict_validator(run_id: str, auditors: frozenset[str] | None
                      ) -> Callable[[bytes, str], tuple[AuditVerdict, str]]:
    def validate(data: bytes, from_peer: str) -> tuple[AuditVerdict, str]:
        return open_verdict(data, run_id=run_id, auditors=auditors)

    return validate
