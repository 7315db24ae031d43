"""Rollout records: what a worker generated, with the proofs and the signature a validator checks.

A :class:`RolloutRecord` carries the problem it answers, the exact prompt and completion token IDs, the
worker's per-token logprobs, the sampling seed and parameters (sampling is reproducible from them, see
``proofs/sampling.py``), the policy version and the CID of the policy checkpoint it was sampled from, the
TOPLOC proofs (258 bytes per 32 generated tokens) and the worker's ed25519 signature over the canonical
encoding of every other field (domain :data:`ROLLOUT_DOMAIN`).

A :class:`RolloutBatch` is the unit a worker submits: signed records of one run and one policy version.
Decoding is strict (``codec.decode``) and then checks the invariants a validator relies on before any
tensor is built: sizes, lengths, finite numbers, sane sampling parameters.
"""

from __future__ import annotations

import math

import msgspec

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.signing import SigningKey, verify_signature

ROLLOUT_DOMAIN = "intellect/rollout/1"
MAX_TOKENS = 8192
"""Prompt plus completion tokens in one rollout (the embedded model's context is 256)."""
MAX_ROLLOUT_SIZE = 1 << 20
MAX_BATCH_ROLLOUTS = 1024
MAX_BATCH_SIZE = 64 << 20
MAX_ID_LEN = 128
MAX_VOCAB = 1 << 24
PROOF_CHUNK = 32
"""Generated tokens per TOPLOC proof (the reference library's decode_batching_size)."""


class SamplingParams(codec.Message, frozen=True):
    """How the completion was sampled. ``seed`` keys the reproducible Gumbel noise."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0


class RolloutRecord(codec.Message, frozen=True):
    run_id: str
    rollout_id: str
    task_id: str
    problem_id: str
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    """log p(token) under the policy at the sampling temperature (full softmax of logits / T)."""
    sampling: SamplingParams
    policy_version: int
    checkpoint_cid: str
    dtype: str
    reward: float
    proofs: list[bytes]
    worker: str
    signature: bytes = b""

    def signed_payload(self) -> bytes:
        """The canonical bytes the worker signs: the record with an empty signature."""
        return codec.encode(msgspec.structs.replace(self, signature=b""))


def sign_rollout(record: RolloutRecord, key: SigningKey) -> RolloutRecord:
    """The record with ``worker`` set to ``key``'s peer ID and its signature filled in."""
    unsigned = msgspec.structs.replace(record, worker=key.peer_id, signature=b"")
    signature = key.sign_bytes(ROLLOUT_DOMAIN, unsigned.signed_payload())
    return msgspec.structs.replace(unsigned, signature=signature)


def verify_rollout_signature(record: RolloutRecord) -> None:
    """ProtocolError unless ``record.signature`` is ``record.worker``'s over the record."""
    verify_signature(record.worker, ROLLOUT_DOMAIN, record.signed_payload(), record.signature)


def check_record(r: RolloutRecord) -> RolloutRecord:
    """Structural invariants (no signature check); ProtocolError naming the first one broken."""
    for name in ("run_id", "rollout_id", "task_id", "problem_id", "dtype"):
        v = getattr(r, name)
        if not v or len(v) > MAX_ID_LEN:
            raise ProtocolError(f"rollout {name} must have 1..{MAX_ID_LEN} characters")
    n_prompt, n_out = len(r.prompt_tokens), len(r.completion_tokens)
    if n_prompt == 0 or n_out == 0 or n_prompt + n_out > MAX_TOKENS:
        raise ProtocolError(f"rollout has {n_prompt} prompt and {n_out} completion tokens "
                            f"(each >= 1, together <= {MAX_TOKENS})")
    if any(not 0 <= t < MAX_VOCAB for t in r.prompt_tokens) or any(
            not 0 <= t < MAX_VOCAB for t in r.completion_tokens):
        raise ProtocolError("token ID out of range")
    if len(r.logprobs) != n_out:
        raise ProtocolError(f"{len(r.logprobs)} logprobs for {n_out} completion tokens")
    if any(not (math.isfinite(x) and x <= 0.0) for x in r.logprobs):
        raise ProtocolError("logprobs must be finite and <= 0")
    s = r.sampling
    if not (math.isfinite(s.temperature) and 0.0 < s.temperature <= 100.0):
        raise ProtocolError("temperature must be in (0, 100]")
    if not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
        raise ProtocolError("top_p must be in (0, 1]")
    if not 1 <= s.max_new_tokens <= MAX_TOKENS or n_out > s.max_new_tokens:
        raise ProtocolError(f"{n_out} completion tokens exceed max_new_tokens {s.max_new_tokens}")
    if not 0 <= s.seed < 1 << 64:
        raise ProtocolError("seed must be a 64-bit unsigned integer")
    if not 0 <= r.policy_version < 1 << 63:
        raise ProtocolError("policy_version out of range")
    validate_cid(r.checkpoint_cid)
    if not math.isfinite(r.reward):
        raise ProtocolError("reward must be finite")
    want = -(-n_out // PROOF_CHUNK)
    if len(r.proofs) != want:
        raise ProtocolError(f"{len(r.proofs)} proofs for {n_out} tokens, expected {want}")
    return r


def encode_rollout(record: RolloutRecord) -> bytes:
    return codec.encode(record)


def decode_rollout(data: bytes) -> RolloutRecord:
    """Strictly decode one record and check its invariants (the signature is checked separately)."""
    return check_record(codec.decode(data, RolloutRecord, max_size=MAX_ROLLOUT_SIZE))


class RolloutBatch(codec.Message, frozen=True):
    """Signed rollouts a worker submits together (one run, one policy version)."""

    run_id: str
    policy_version: int
    rollouts: list[RolloutRecord]


def encode_batch(batch: RolloutBatch) -> bytes:
    return codec.encode(batch)


def decode_batch(data: bytes) -> RolloutBatch:
    batch = codec.decode(data, RolloutBatch, max_size=MAX_BATCH_SIZE)
    if not 1 <= len(batch.rollouts) <= MAX_BATCH_ROLLOUTS:
        raise ProtocolError(f"a batch holds 1..{MAX_BATCH_ROLLOUTS} rollouts, got {len(batch.rollouts)}")
    for r in batch.rollouts:
        check_record(r)
        if r.run_id != batch.run_id or r.policy_version != batch.policy_version:
            raise ProtocolError(f"rollout {r.rollout_id[:40]!r} is for another run or policy version")
    if len({r.rollout_id for r in batch.rollouts}) != len(batch.rollouts):
        raise ProtocolError("duplicate rollout_id in batch")
    return batch
