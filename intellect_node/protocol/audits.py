"""Audit verdicts (gossip topic ``/intellect/<run_id>/audits/1``): an auditor's word on one step record.

An auditor (``roles/auditor/``) replays the trainer's steps from their signed records
(``protocol/steps.py``) and signs one :class:`AuditVerdict` per record it audited: ``pass`` (the replay
made the published ``checkpoint_hash``), ``fail`` (it made ``expected``, or the record contradicts
itself or the run: ``reason``) or ``unavailable`` (the audit could not run: a batch missing, the start
not held). ``unavailable`` is never a pass.

A verdict carries the time it was sealed (``time_ms``, set by :func:`seal_verdict`): receivers ignore
one outside :func:`verdict_time_error`'s window at the gossip validator, so a replay is neither
forwarded nor blamed on anyone. The field is left out of the bytes when unset, so a verdict of an
auditor of the release before it still decodes (undated: taken, without the window; every repeat of
its signed bytes is still ignored, ``roles/common/audits.py``).
"""

from __future__ import annotations

import time
from typing import Callable, Literal

import msgspec

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.freshness import check_stamp
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.signing import SigningKey, open_envelope, open_published
from intellect_node.protocol.topics import validate_run_id

AUDIT_DOMAIN = "intellect/audit/1"
AUDIT_KIND = "audits"  # the topic kind: /intellect/<run_id>/audits/1
MAX_AUDIT_BYTES = 4096
MAX_REASON_LEN = 1024
VERDICT_MAX_AGE_MS = 300_000
"""A verdict sealed longer ago than this (by the receiver's clock) is ignored: an auditor publishes each
verdict once, sealed just before, and gossip delivers in seconds; only replays (and clocks minutes apart)
fall outside. The batch verdicts' window (``protocol.rl``)."""
VERDICT_MAX_AHEAD_MS = 60_000
"""A verdict dated further ahead than this is ignored (a broken clock, or one sealed to outlive the
window)."""


class AuditVerdict(codec.Message, frozen=True):
    run_id: str
    trainer: str  # the peer ID whose record was audited
    seq: int
    version: int
    outcome: Literal["pass", "fail", "unavailable"]
    published: str  # the record's checkpoint hash
    expected: str = ""  # the hash the replay made ("" when it did not run)
    reason: str = ""
    time_ms: int | msgspec.UnsetType = msgspec.UNSET
    """When the auditor sealed it (unix ms; :func:`seal_verdict` sets it); unset in an older auditor's
    verdicts."""


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
    if not isinstance(v.time_ms, msgspec.UnsetType) and not 0 < v.time_ms < 1 << 53:
        raise ProtocolError(f"audit verdict time {v.time_ms} out of range")
    return v


def seal_verdict(key: SigningKey, v: AuditVerdict, *, now_ms: int | None = None) -> bytes:
    """Sign ``v``, dated now (``now_ms``, unix ms) unless it carries a time already."""
    if isinstance(v.time_ms, msgspec.UnsetType):
        v = msgspec.structs.replace(v, time_ms=int(time.time() * 1000) if now_ms is None else now_ms)
    return key.seal(AUDIT_DOMAIN, check_verdict(v))


def check_verdict_time(v: AuditVerdict, now_ms: int) -> None:
    """``MessageIgnored`` unless ``v`` was sealed inside the window around ``now_ms`` (unix ms): at most
    :data:`VERDICT_MAX_AGE_MS` before it, :data:`VERDICT_MAX_AHEAD_MS` after. An undated verdict (an
    older auditor's) passes."""
    if not isinstance(v.time_ms, msgspec.UnsetType):
        check_stamp(v.time_ms, now_ms, max_age_ms=VERDICT_MAX_AGE_MS, max_ahead_ms=VERDICT_MAX_AHEAD_MS,
                    what="audit verdict")


def _not_an_auditor(signer: str) -> str:
    return f"audit verdict signed by {signer}, not one of the run's auditors"


def open_verdict(data: bytes, *, run_id: str, auditors: frozenset[str] | None) -> tuple[AuditVerdict, str]:
    """Decode and verify a verdict for ``run_id``; ``auditors``: the signers accepted (None: any)."""
    v, signer = open_envelope(data, AUDIT_DOMAIN, AuditVerdict, max_size=MAX_AUDIT_BYTES)
    if auditors is not None and signer not in auditors:
        raise ProtocolError(_not_an_auditor(signer))
    if v.run_id != run_id:
        raise ProtocolError(f"audit verdict for run {v.run_id[:128]!r}, this node is in {run_id!r}")
    return check_verdict(v), signer


def verdict_validator(run_id: str, auditors: frozenset[str] | None
                      ) -> Callable[[bytes, str], tuple[AuditVerdict, str]]:
    """Gossip validator: a verdict of this run, published by its signer (one of ``auditors``; any if
    None), sealed inside the window (else ``MessageIgnored``)."""

    def validate(data: bytes, origin: str) -> tuple[AuditVerdict, str]:
        v, signer = open_published(data, origin, AUDIT_DOMAIN, AuditVerdict, max_size=MAX_AUDIT_BYTES,
                                   run_id=run_id, what="audit verdict", signers=auditors,
                                   unlisted=_not_an_auditor)
        v = check_verdict(v)
        check_verdict_time(v, int(time.time() * 1000))
        return v, signer

    return validate
