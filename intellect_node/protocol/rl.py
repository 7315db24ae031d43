"""RL gossip messages: a worker's notice of a rollout batch, and a validator's verdict on it.

Flow (topics ``/intellect/<run_id>/rollouts/1`` and ``/intellect/<run_id>/verdicts/1``):

1. A worker puts its :class:`~intellect_node.protocol.rollout.RolloutBatch` in the blob store and gossips
   a :class:`RolloutNotice` naming the blob (``batch_cid``), signed with its key (:data:`NOTICE_DOMAIN`).
   Every record inside must name the same worker: a notice cannot pass off someone else's rollouts.
2. Validators fetch the blob, verify it and gossip a :class:`BatchVerdict` (:data:`VERDICT_DOMAIN`). Only
   validators listed in the run configuration are trusted; the trainer ignores the rest.
3. The trainer trains on a batch only once a trusted validator accepted it.

A verdict covers the whole batch: one rejected rollout rejects the batch (the trainer then has no
partial group to make sense of), and the first rejection's reason is carried for the worker's ledger.

A verdict is signed by the validator that published it (gossip origin == signer) and carries the time it
was sealed: anyone can replay signed gossip once the gossip layer's seen-cache has forgotten it, so a
receiver acts only on verdicts inside a bounded window around its own clock (:func:`verdict_time_error`).
Reasons in :data:`NOT_WORKERS_FAULT` say the validator could not judge the batch, not that it is bad: they
decide nothing at the trainer.
"""

from __future__ import annotations

import re
import time
from typing import Callable

import msgspec

from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import public_key_from_peer_id, validate_cid
from intellect_node.protocol.signing import SigningKey, open_published
from intellect_node.protocol.topics import validate_run_id

NOTICE_DOMAIN = "intellect/rollout-notice/1"
VERDICT_DOMAIN = "intellect/verdict/1"
NOTICE_KIND = "rollouts"
VERDICT_KIND = "verdicts"
MAX_NOTICE_BYTES = 1024
MAX_VERDICT_BYTES = 2048
MAX_REASON_LEN = 64
MAX_DETAIL_LEN = 400
MAX_BATCH_ROLLOUTS = 1024  # same bound as protocol.rollout
VERDICT_MAX_AGE_MS = 300_000
"""A verdict older than this (by the receiver's clock) is ignored: gossip delivers in seconds and a
validator re-seals what it re-sends, so only replays (and clocks minutes apart) fall outside."""
VERDICT_MAX_AHEAD_MS = 60_000
"""A verdict dated further ahead than this is ignored (a broken clock, or one sealed to outlive the
age window)."""
NOT_WORKERS_FAULT = frozenset({"stale", "policy_version", "reward_unjudged"})
"""Verdict reasons that say the validator could not judge the batch (the swarm moved on; it lacks the
policy; its reward checker ran out of time on a completion a faster node scores): never held against
the worker, and at the trainer they decide nothing while another validator can."""
_REASON_RE = re.compile(r"[a-z_]*")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def now_ms() -> int:
    """Wall-clock time in unix milliseconds (what verdicts are dated with)."""
    return time.time_ns() // 1_000_000


class RolloutNotice(codec.Message, frozen=True):
    run_id: str
    batch_cid: str
    """Manifest CID of the blob holding the encoded RolloutBatch."""
    policy_version: int
    n_rollouts: int
    batch_bytes: int
    """Size of the encoded batch, so a receiver can refuse an oversize blob before fetching it."""


class BatchVerdict(codec.Message, frozen=True):
    run_id: str
    batch_cid: str
    worker: str
    policy_version: int
    accepted: bool
    n_accepted: int
    n_rejected: int
    reason: str = ""
    """Machine-readable reason of the first rejection: a ``Verifier`` reason, or "stale", "groups",
    "duplicate" (rollouts already counted), "unavailable" (the signer did not serve the blob in time),
    "policy_version" (no such policy to check against)."""
    detail: str = ""
    """Free text for people (no control characters; validators build it with peer-supplied IDs cleaned)."""
    ban: bool = False
    """The validator banned ``worker`` with this verdict (its rejection count reached the run's limit).
    The trainer bans the worker only when ``run.verdict_quorum`` validators say so."""
    time_ms: int = msgspec.field(default_factory=now_ms)
    """When the validator sealed it (unix ms; set at construction). Decoding requires it: a message
    without it is not canonically encoded."""


def _check_common(run_id: str, cid: str, version: int, n: int) -> None:
    validate_run_id(run_id)
    validate_cid(cid)
    if not 0 <= version < 1 << 62:
        raise ProtocolError(f"policy version {version} out of range")
    if not 0 <= n <= MAX_BATCH_ROLLOUTS:
        raise ProtocolError(f"rollout count {n} out of range")


def check_notice(n: RolloutNotice) -> RolloutNotice:
    _check_common(n.run_id, n.batch_cid, n.policy_version, n.n_rollouts)
    if n.n_rollouts < 1:
        raise ProtocolError("a notice names at least one rollout")
    if not 0 < n.batch_bytes <= 64 << 20:
        raise ProtocolError(f"batch of {n.batch_bytes} bytes out of range")
    return n


def check_verdict(v: BatchVerdict) -> BatchVerdict:
    _check_common(v.run_id, v.batch_cid, v.policy_version, v.n_accepted + v.n_rejected)
    if v.n_accepted < 0 or v.n_rejected < 0:
        raise ProtocolError("negative counts")
    if v.accepted != (v.n_rejected == 0 and v.n_accepted > 0):
        raise ProtocolError("accepted must mean: no rollout rejected")
    if len(v.reason) > MAX_REASON_LEN or len(v.detail) > MAX_DETAIL_LEN:
        raise ProtocolError("reason or detail too long")
    if not _REASON_RE.fullmatch(v.reason) or _CONTROL_RE.search(v.detail):
        raise ProtocolError("reason must be [a-z_]*, detail without control characters")
    if not 0 < v.time_ms < 1 << 53:
        raise ProtocolError(f"verdict time {v.time_ms} out of range")
    if v.accepted and (v.reason or v.ban):
        raise ProtocolError("an accepting verdict carries no reason and no ban")
    public_key_from_peer_id(v.worker)
    return v


def verdict_time_error(v: BatchVerdict, now: int) -> str:
    """Why ``v`` is outside the window a receiver at ``now`` (unix ms) acts in; "" when inside."""
    if v.time_ms < now - VERDICT_MAX_AGE_MS:
        return f"verdict sealed {(now - v.time_ms) / 1000:.0f} s ago (replayed, or a clock behind)"
    if v.time_ms > now + VERDICT_MAX_AHEAD_MS:
        return f"verdict dated {(v.time_ms - now) / 1000:.0f} s ahead (a clock ahead)"
    return ""


def seal_notice(key: SigningKey, notice: RolloutNotice) -> bytes:
    return key.seal(NOTICE_DOMAIN, check_notice(notice))


def seal_verdict(key: SigningKey, verdict: BatchVerdict) -> bytes:
    return key.seal(VERDICT_DOMAIN, check_verdict(verdict))


def _not_allowed(signer: str) -> str:
    return f"not_allowed: {signer} is not on the run's worker allowlist"


def _not_a_validator(signer: str) -> str:
    return f"verdict signed by {signer}, not one of the run's validators"


def notice_validator(run_id: str, allowed: frozenset[str] | None = None
                     ) -> Callable[[bytes, str], tuple[RolloutNotice, str]]:
    """Gossip validator: a notice of this run, signed by the peer that published it; in a closed run
    (``allowed``: ``run.worker_allowlist``) only from a listed worker (else ``not_allowed: ...``)."""

    def validate(data: bytes, origin: str) -> tuple[RolloutNotice, str]:
        notice, signer = open_published(data, origin, NOTICE_DOMAIN, RolloutNotice,
                                        max_size=MAX_NOTICE_BYTES, run_id=run_id, what="notice",
                                        signers=allowed, unlisted=_not_allowed)
        return check_notice(notice), signer

    return validate


def verdict_validator(run_id: str, trusted: frozenset[str] | None, *,
                      on_ignored: Callable[[BatchVerdict, str, str], None] | None = None,
                      now: Callable[[], int] = now_ms) -> Callable[[bytes, str], tuple[BatchVerdict, str]]:
    """Gossip validator: a verdict of this run signed by the peer that published it, a trusted validator
    (any signer if ``None``). One outside the time window (:func:`verdict_time_error`) raises
    ``MessageIgnored``: not forwarded, and held against no one (a replay of a validator's old verdict is
    not that validator's doing, and the peer that forwarded it may have checked it just before it
    expired); ``on_ignored(verdict, signer, why)`` is told first. Receivers check the time again when
    they act on it."""

    def validate(data: bytes, origin: str) -> tuple[BatchVerdict, str]:
        verdict, signer = open_published(data, origin, VERDICT_DOMAIN, BatchVerdict,
                                         max_size=MAX_VERDICT_BYTES, run_id=run_id, what="verdict",
                                         signers=trusted, unlisted=_not_a_validator)
        check_verdict(verdict)
        if why := verdict_time_error(verdict, now()):
            if on_ignored is not None:
                on_ignored(verdict, signer, why)
            raise MessageIgnored(why)
        return verdict, signer

    return validate
