"""Held-out evaluation results (gossip topic ``/intellect/<run_id>/evals/1``): one node's measure of a policy.

A validator with ``validator.evaluate`` on evaluates policy versions ``0, N, 2N, ...`` (``run.eval_every``)
on the run's held-out problems (``envs/heldout.py``), one completion each under sampler keys fixed by
``run.eval_seed`` (``roles/validator/evals.py``), and signs one :class:`EvalResult` per version: the
policy's hash, every problem's reward in the held-out order, their mean, the pass rate (the share with
full credit) and the digest of the rewards (:func:`outcomes_digest`).

The result carries its rewards (at most :data:`MAX_PROBLEMS`), so a receiver checks the figures and the
digest from them before it counts the result (:func:`check_result`: a result whose pass rate, mean or
digest does not follow from its rewards is refused and held against its signer), and any node holding
the policy can evaluate any of the problems again under the same keys and compare
(``validator.eval_recheck_fraction``).

A result carries the time it was sealed: one outside the window of :func:`check_result_time`, or a
repeat of one already taken, is ignored at the gossip validator (neither forwarded nor blamed), as for
the other dated messages (``protocol/freshness.py``).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections.abc import Sequence
from typing import Callable

import msgspec

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.freshness import check_stamp
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.signing import SigningKey, open_envelope, open_published
from intellect_node.protocol.topics import validate_run_id

EVAL_DOMAIN = "intellect/eval/1"
EVAL_KIND = "evals"  # the topic kind: /intellect/<run_id>/evals/1
OUTCOMES_DOMAIN = b"intellect/eval-outcomes/1\0"
MAX_PROBLEMS = 512
"""The most problems one result covers (``run.eval_problems``' bound): every reward fits in the message."""
MAX_EVAL_BYTES = 8192
"""A result of 512 rewards encodes in about 4.8 KB (msgpack float64s and the fixed fields)."""
RESULT_MAX_AGE_MS = 300_000
"""A result sealed longer ago than this (by the receiver's clock) is ignored: an evaluator publishes each
result once, sealed just before; the audit verdicts' window (``protocol.audits``)."""
RESULT_MAX_AHEAD_MS = 60_000
"""A result dated further ahead than this is ignored."""


class EvalResult(codec.Message, frozen=True):
    run_id: str
    version: int
    policy: str
    """The content hash (CID) of the policy evaluated: the one the trainer announced for ``version``."""
    seed: int
    """``run.eval_seed``: the sampler keys' seed."""
    rewards: list[float]
    """Each held-out problem's reward, in the held-out order (``envs/heldout.py``); ``n`` of them."""
    mean_reward: float
    pass_rate: float
    outcomes: str
    """:func:`outcomes_digest` of ``rewards`` (hex)."""
    time_ms: int
    """When the evaluator sealed it (unix ms)."""

    @property
    def n(self) -> int:
        return len(self.rewards)


def outcomes_digest(rewards: Sequence[float]) -> str:
    """sha256 (hex) over the rewards' canonical encoding: the domain, then each reward as a big-endian
    IEEE-754 double, in order."""
    return hashlib.sha256(OUTCOMES_DOMAIN + struct.pack(f">{len(rewards)}d", *rewards)).hexdigest()


def figures(rewards: Sequence[float]) -> tuple[float, float]:
    """``(mean_reward, pass_rate)`` of ``rewards``: the evaluator's and every receiver's arithmetic, so the
    figures a result states are compared exactly."""
    return sum(rewards) / len(rewards), sum(r >= 1.0 for r in rewards) / len(rewards)


def make_result(*, run_id: str, version: int, policy: str, seed: int, rewards: Sequence[float]) -> EvalResult:
    """The result of ``rewards`` (figures and digest computed here), dated now at :func:`seal_result`."""
    rs = [float(r) for r in rewards]
    mean, rate = figures(rs)
    return EvalResult(run_id=run_id, version=version, policy=policy, seed=seed, rewards=rs,
                      mean_reward=mean, pass_rate=rate, outcomes=outcomes_digest(rs), time_ms=0)


def check_result(r: EvalResult) -> EvalResult:
    """``r`` if it is well formed and its figures and digest follow from its rewards; else ProtocolError."""
    validate_run_id(r.run_id)
    if not 0 <= r.version < 1 << 62 or not 0 <= r.seed < 1 << 63 or not 0 < r.time_ms < 1 << 53:
        raise ProtocolError("eval result: version, seed or time out of range")
    validate_cid(r.policy)
    if not 1 <= len(r.rewards) <= MAX_PROBLEMS:
        raise ProtocolError(f"eval result of {len(r.rewards)} problems, 1..{MAX_PROBLEMS}")
    if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in r.rewards):
        raise ProtocolError("eval result: a reward outside [0, 1]")
    if r.outcomes != outcomes_digest(r.rewards):
        raise ProtocolError("eval result: the outcomes digest is not its rewards'")
    if (r.mean_reward, r.pass_rate) != figures(r.rewards):
        raise ProtocolError(f"eval result: mean reward {r.mean_reward!r} and pass rate {r.pass_rate!r} are "
                            "not its rewards'")
    return r


def seal_result(key: SigningKey, r: EvalResult, *, now_ms: int | None = None) -> bytes:
    """Sign ``r``, dated now (``now_ms``, unix ms)."""
    r = msgspec.structs.replace(r, time_ms=int(time.time() * 1000) if now_ms is None else now_ms)
    return key.seal(EVAL_DOMAIN, check_result(r))


def check_result_time(r: EvalResult, now_ms: int) -> None:
    """``MessageIgnored`` unless ``r`` was sealed inside the window around ``now_ms`` (unix ms)."""
    check_stamp(r.time_ms, now_ms, max_age_ms=RESULT_MAX_AGE_MS, max_ahead_ms=RESULT_MAX_AHEAD_MS,
                what="eval result")


def open_result(data: bytes, *, run_id: str) -> tuple[EvalResult, str]:
    """Decode, verify and check a result of ``run_id``: ``(result, signer)``."""
    r, signer = open_envelope(data, EVAL_DOMAIN, EvalResult, max_size=MAX_EVAL_BYTES)
    if r.run_id != run_id:
        raise ProtocolError(f"eval result for run {r.run_id[:128]!r}, this node is in {run_id!r}")
    return check_result(r), signer


def result_validator(run_id: str) -> Callable[[bytes, str], tuple[EvalResult, str]]:
    """Gossip validator: a result of this run, published by its signer, sealed inside the window (else
    ``MessageIgnored``). Any node may evaluate: the figures are checkable, not trusted."""

    def validate(data: bytes, origin: str) -> tuple[EvalResult, str]:
        r, signer = open_published(data, origin, EVAL_DOMAIN, EvalResult, max_size=MAX_EVAL_BYTES,
                                   run_id=run_id, what="eval result")
        r = check_result(r)
        check_result_time(r, int(time.time() * 1000))
        return r, signer

    return validate
