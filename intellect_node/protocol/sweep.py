"""Sweep messages on ``/intellect/<run>/sweep/1``: signed job offers, claims, grants and results.

The exchange (every message is an :class:`~intellect_node.protocol.signing.Envelope` with its own domain
tag, so a claim's signature cannot be replayed as a result)::

    coordinator -> all     Offer   a sweep exists; here is a window of open jobs (specs)
    worker -> coordinator  Claim   I am idle: these job IDs, or any, up to ``capacity``
    coordinator -> worker  Grant   run these jobs (specs) before these deadlines
    worker -> coordinator  Result  job ID, polysemantic count, sign-pattern hash, curve

A grant does not say whether a job is a first execution or a spot check, so a worker cannot tell which
of its results will be re-executed. A job's ID is the CID of its spec's canonical encoding: every peer
computes it, nobody has to trust it.

Receivers bound every number before anything is allocated or run: a hostile coordinator must not be
able to make a worker train a 10^6 x 10^6 matrix, nor a hostile worker make the coordinator store a huge
curve. Decoding is strict (``codec.decode``), and unknown domains are refused.
"""

from __future__ import annotations

import math
import re
from typing import Union

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.freshness import check_stamp
from intellect_node.protocol.ids import cid_of, public_key_from_peer_id, validate_cid
from intellect_node.protocol.signing import ENVELOPE_OVERHEAD, Envelope, SigningKey, verify_signature
from intellect_node.protocol.topics import validate_run_id

OFFER_DOMAIN = "intellect/sweep-offer/1"
CLAIM_DOMAIN = "intellect/sweep-claim/1"
GRANT_DOMAIN = "intellect/sweep-grant/1"
RESULT_DOMAIN = "intellect/sweep-result/1"

MAX_MESSAGE_SIZE = 64 << 10
"""Bytes of one sweep payload; the largest is an offer or grant of :data:`MAX_JOBS_PER_MESSAGE` specs."""
MAX_JOBS_PER_MESSAGE = 64
MAX_CAPACITY = 64
MAX_CURVE_POINTS = 1025
"""Fourth-norm samples in one result: 100k steps sampled every 100 steps, plus step 0."""
MAX_N = 4096
MAX_M = 16384
MAX_WEIGHTS = 1 << 24
"""n * m bound (64 MiB of float32 weights): the paper grid's largest is 256 x 4096 = 2^20."""
MAX_STEPS = 1_000_000
MAX_SEED = (1 << 63) - 1
MAX_CLOCK_SKEW_MS = 5 * 60 * 1000
"""Messages stamped further than this from the receiver's clock are ignored (``MessageIgnored``)."""
VARIANTS = ("poly", "noise")
NOISE_KINDS = ("none", "bernoulli", "gaussian")
SWEEP_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


class JobSpec(codec.Message, frozen=True):
    """One training run. ``variant`` "poly" is the main experiment, "noise" the noise variant."""

    variant: str
    n: int
    m: int
    seed: int
    steps: int
    lr: float
    l1: float
    weight_decay: float = 0.0  # AdamW's decoupled decay (poly); unused by plain SGD (noise)
    noise: str = "none"
    sigma: float = 0.0
    record_every: int = 0  # fourth-norm sampling period in steps (noise variant), 0 = none


class Offer(codec.Message, frozen=True):
    run_id: str
    sweep_id: str
    time_ms: int
    open_jobs: int  # jobs still needing an execution (the window below may be shorter)
    finished: bool  # the sweep is complete: workers can stop claiming
    jobs: list[JobSpec]


class Claim(codec.Message, frozen=True):
    run_id: str
    sweep_id: str
    time_ms: int
    coordinator: str  # peer ID the claim is addressed to
    job_ids: list[str]  # preferred jobs (from an offer); empty = any
    capacity: int  # how many jobs the worker takes now


class Assignment(codec.Message, frozen=True):
    job: JobSpec
    deadline_ms: int  # unix ms; after it the job may be given to another peer


class Grant(codec.Message, frozen=True):
    run_id: str
    sweep_id: str
    time_ms: int
    worker: str  # peer ID the grant is for
    assignments: list[Assignment]


class Result(codec.Message, frozen=True):
    run_id: str
    sweep_id: str
    time_ms: int
    coordinator: str
    job_id: str
    polysemantic: int
    sign_hash: str  # sha256 hex of the thresholded sign pattern
    final_loss: float
    fourth_norm: list[tuple[int, float]] = []
    seconds: float = 0.0  # wall time the worker reports (informational)


SweepMessage = Union[Offer, Claim, Grant, Result]
_DOMAIN_TYPES: dict[str, type[SweepMessage]] = {OFFER_DOMAIN: Offer, CLAIM_DOMAIN: Claim, GRANT_DOMAIN: Grant,
                                                RESULT_DOMAIN: Result}
_TYPE_DOMAINS = {t: d for d, t in _DOMAIN_TYPES.items()}


def job_id(spec: JobSpec) -> str:
    """The CID of the spec's canonical encoding."""
    return cid_of(codec.encode(spec))


def _finite(x: float, what: str, lo: float, hi: float) -> None:
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ProtocolError(f"{what} {x!r} outside [{lo}, {hi}]")


def check_spec(spec: JobSpec) -> JobSpec:
    """ProtocolError unless the spec is runnable within this node's limits."""
    if spec.variant not in VARIANTS:
        raise ProtocolError(f"unknown job variant {spec.variant[:32]!r}")
    if not (1 <= spec.n <= MAX_N and 1 <= spec.m <= MAX_M and spec.n * spec.m <= MAX_WEIGHTS):
        raise ProtocolError(f"job size n={spec.n} m={spec.m} outside the limits")
    if not (1 <= spec.steps <= MAX_STEPS) or not (0 <= spec.seed <= MAX_SEED):
        raise ProtocolError("job steps or seed out of range")
    _finite(spec.lr, "lr", 0.0, 10.0)
    _finite(spec.l1, "l1", 0.0, 10.0)
    _finite(spec.weight_decay, "weight_decay", 0.0, 10.0)
    _finite(spec.sigma, "sigma", 0.0, 10.0)
    if spec.noise not in NOISE_KINDS or (spec.variant == "poly" and spec.noise != "none"):
        raise ProtocolError(f"bad noise {spec.noise[:32]!r} for variant {spec.variant}")
    if not 0 <= spec.record_every <= MAX_STEPS or (spec.variant == "noise") != (spec.record_every > 0):
        raise ProtocolError("record_every out of range (noise jobs sample their curve, poly jobs do not)")
    if spec.record_every and spec.steps // spec.record_every + 1 > MAX_CURVE_POINTS:
        raise ProtocolError("record_every gives too many curve points")
    return spec


def curve_points(spec: JobSpec) -> int:
    """Samples a correct result's fourth-norm curve has for ``spec`` (0 when none are recorded)."""
    return spec.steps // spec.record_every + 1 if spec.variant == "noise" and spec.record_every else 0


def _check_common(msg: SweepMessage, run_id: str) -> None:
    validate_run_id(msg.run_id)
    if msg.run_id != run_id:
        raise ProtocolError(f"sweep message for run {msg.run_id[:64]!r}, this node is in {run_id!r}")
    if not SWEEP_ID_RE.match(msg.sweep_id):
        raise ProtocolError(f"bad sweep id {msg.sweep_id[:80]!r}")


def check_message(msg: SweepMessage) -> SweepMessage:
    """Invariants beyond the types: list lengths, specs, hashes, finite numbers."""
    if isinstance(msg, Offer):
        if len(msg.jobs) > MAX_JOBS_PER_MESSAGE or msg.open_jobs < 0:
            raise ProtocolError("offer out of range")
        for spec in msg.jobs:
            check_spec(spec)
    elif isinstance(msg, Claim):
        public_key_from_peer_id(msg.coordinator)
        if len(msg.job_ids) > MAX_JOBS_PER_MESSAGE or not 1 <= msg.capacity <= MAX_CAPACITY:
            raise ProtocolError("claim out of range")
        for jid in msg.job_ids:
            validate_cid(jid)
    elif isinstance(msg, Grant):
        public_key_from_peer_id(msg.worker)
        if len(msg.assignments) > MAX_JOBS_PER_MESSAGE:
            raise ProtocolError("grant out of range")
        for a in msg.assignments:
            check_spec(a.job)
    elif isinstance(msg, Result):
        public_key_from_peer_id(msg.coordinator)
        validate_cid(msg.job_id)
        if not HEX64_RE.match(msg.sign_hash) or not 0 <= msg.polysemantic <= MAX_M:
            raise ProtocolError("result hash or count malformed")
        if len(msg.fourth_norm) > MAX_CURVE_POINTS:
            raise ProtocolError("result curve too long")
        if not math.isfinite(msg.final_loss) or not (math.isfinite(msg.seconds) and msg.seconds >= 0):
            raise ProtocolError("result numbers not finite")
        for step, value in msg.fourth_norm:
            if not (0 <= step <= MAX_STEPS and math.isfinite(value)):
                raise ProtocolError("result curve point out of range")
    return msg


def seal(key: SigningKey, msg: SweepMessage) -> bytes:
    """Sign ``msg`` with ``key`` under the domain of its kind; the encoded envelope."""
    return key.seal(_TYPE_DOMAINS[type(msg)], msg)


def open_message(data: bytes, *, run_id: str, now_ms: int) -> tuple[SweepMessage, str]:
    """Decode, verify and check one sweep envelope; return the message and its signer's peer ID. One
    stamped more than :data:`MAX_CLOCK_SKEW_MS` from ``now_ms`` raises ``MessageIgnored``."""
    env = codec.decode(data, Envelope, max_size=MAX_MESSAGE_SIZE + ENVELOPE_OVERHEAD)
    type_ = _DOMAIN_TYPES.get(env.domain)
    if type_ is None:
        raise ProtocolError(f"not a sweep message domain: {env.domain[:64]!r}")
    verify_signature(env.signer, env.domain, env.payload, env.signature)
    msg = codec.decode(env.payload, type_, max_size=MAX_MESSAGE_SIZE)
    _check_common(msg, run_id)
    check_message(msg)
    check_stamp(msg.time_ms, now_ms, max_age_ms=MAX_CLOCK_SKEW_MS, max_ahead_ms=MAX_CLOCK_SKEW_MS,
                what="sweep message")
    return msg, env.signer
