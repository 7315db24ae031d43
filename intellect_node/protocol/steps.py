"""Step records (gossip topic ``/intellect/<run_id>/steps/1``): what the trainer says each step trained on.

With every step it takes (every journaled step: one that trained and made a new policy version, and one
whose groups all had equal rewards and made none), the run's trainer publishes one signed
:class:`StepRecord`, on the run's ``steps`` topic and as a blob in its store:

- ``base_version``/``base_hash``: the policy the step started from (its checkpoint hash, the CID the
  version's announcement carries); ``version``/``checkpoint_hash``: the policy it made (the same as the
  base when nothing trained);
- ``batches``: the batches the step took, in the order their groups were trained, each with its worker,
  its group count, which of its groups trained (``trained``: indices; the others had equal rewards,
  nothing to learn from) and the evidence that admitted it (``evidence``: the signed accepting
  ``BatchVerdict`` envelopes of ``run.verdict_quorum`` of the run's validators, as gossiped; checked by
  ``roles/auditor/evidence.py``); ``stale``: batches the step took out of the queue and dropped unread,
  their rollouts older than ``run.async_level`` versions;
- ``dropped``: batches the validators accepted that the trainer decided, since its previous record, not
  to queue at all, each with why (:data:`DROP_REASONS`: already stale when the quorum came, the trainer's
  own refusal, a banned or unlisted worker, the blob not to be had), so that every accepted batch is
  named by some record;
- ``settings``: every number the GRPO step of ``trainer/step.py`` reads, the lr this step used (after
  warmup and the adaptive scale, ``trainer/stepsize.py``) among them. The step draws no random
  numbers (no dropout, no sampling): the base weights, the optimizer state, the samples in this order and
  these settings decide the new weights, bit for bit on the CPU with one thread;
- ``state`` (:class:`StepState`), only on a step after which the trainer wrote a checkpoint: the blobs
  holding the weights it made and the optimizer state after it (``trainer/optstate.py``), and that
  state's content hash. A window of steps can be replayed by anyone from any such step on.

Receivers check the signer (the run's trainer), the run and the record's own consistency
(:func:`open_record`); a worker's receipts and an auditor's replay read the records alone.
"""

from __future__ import annotations

from typing import Callable

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.rl import MAX_VERDICT_BYTES
from intellect_node.protocol.signing import ENVELOPE_OVERHEAD, SigningKey, open_from_trainer
from intellect_node.protocol.topics import validate_run_id

STEP_DOMAIN = "intellect/step/1"
STEP_KIND = "steps"  # the topic kind: /intellect/<run_id>/steps/1
MAX_STEP_BATCHES = 1024
"""Most batches one record names (taken and stale together): a step takes ``rl.groups_per_step`` groups,
at least one per batch, and the config caps that far below this."""
MAX_BATCH_GROUPS = 1024  # a batch holds at most 1024 rollouts (protocol.rollout), so at most that many groups
MAX_EVIDENCE_BYTES = 512 * 1024
"""Most bytes of verdict envelopes one record carries as evidence: an accepting verdict's envelope is at
most :data:`ACCEPT_ENVELOPE_BYTES`, so ``rl.groups_per_step`` x ``run.verdict_quorum`` <= 1024 fits (the
trainer checks that at start)."""
ACCEPT_ENVELOPE_BYTES = 512
"""An upper bound on an accepting verdict's sealed envelope (480 bytes with a 64-character run ID and the
largest counts and version; no reason, detail or ban)."""
MAX_EVIDENCE_ENVELOPE = MAX_VERDICT_BYTES + ENVELOPE_OVERHEAD  # any verdict envelope, as gossip bounds it
MAX_RECORD_BYTES = 960 * 1024
"""1024 batches of ~ 200 bytes, room for their groups' indices, and the evidence; under gossipsub's 1 MiB
limit."""
MAX_PEER_ID_LEN = 128
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
LOSSES = ("grpo", "intellect2", "prime", "mis")  # trainer/losses.py's (protocol/ imports no torch)
NO_SIGNAL_CAUSES = ("", "all_zero", "all_one", "all_equal", "no_groups")
DROP_REASONS = ("stale", "duplicate", "wrong_task", "not_assigned", "bad_signature", "refused", "banned",
                "not_allowed", "unavailable")
"""Why a trainer drops an accepted batch without queuing it: ``stale`` (older than ``run.async_level``
versions when the quorum came), a refusal of its own after the validators' accept (``inbox.RefusedBatch``
reasons), its worker ``banned`` here or ``not_allowed`` in a closed run, or its blob ``unavailable``."""
_MAX_VERSION = 1 << 62


class StepSettings(codec.Message, frozen=True):
    """The GRPO step's settings (``trainer/grpo.GRPOConfig``, the optimizer's and the loss's)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    group_size: int
    clip_eps_low: float
    clip_eps_high: float
    neg_ratio_cap: float
    max_grad_norm: float
    token_budget: int
    kl_coef: float
    entropy_coef: float
    scale_by_std: bool
    temperature: float
    micro_tokens: int | None
    """The trainer's own micro-batching (``rl.micro_batch_tokens``, not a shared setting): an auditor
    replays with the record's value, which decides the summation order and so the bits."""
    compute_dtype: str | None  # autocast dtype; None: the weights' own (fp32 on the CPU)
    loss: str = "grpo"  # rl.loss: the per-token objective (trainer/losses.py)
    is_cap: float = 2.0
    prob_diff_mask: float = 0.2
    log_ratio_tau: float = 1e-3
    warmup_steps: int = 0  # rl.lr_warmup_steps
    target_kl: float | None = None
    lr_scale: float = 1.0
    """The adaptive step's scale this step trained with (``trainer/stepsize.py``; 1 without
    ``target_kl``): ``lr`` is the run's lr x the warmup's factor x this, the lr the step used."""


class StepBatch(codec.Message, frozen=True):
    cid: str  # the batch blob's CID
    worker: str  # peer ID of the worker that made it
    groups: int  # how many groups it holds
    trained: list[int] = []  # indices of its groups the step trained on (the rest had equal rewards)
    evidence: list[bytes] = []
    """The sealed accepting verdicts that admitted it (taken batches only; empty in ``stale``)."""


class DroppedBatch(codec.Message, frozen=True):
    cid: str
    worker: str
    reason: str  # one of DROP_REASONS


class StepState(codec.Message, frozen=True):
    """The trainer's state after a step it checkpointed: where to fetch a window's start."""

    weights_cid: str  # blob CID of the new version's canonical weights (hash: the record's checkpoint_hash)
    optimizer_cid: str  # blob CID of the optimizer state after the step (trainer/optstate.py)
    optimizer_hash: str  # the content hash of those optimizer bytes


class StepRecord(codec.Message, frozen=True):
    run_id: str
    seq: int  # the trainer's journal sequence number of this step (1, 2, ...; unique in the run)
    step: int  # the trainer's count of trained steps after this one
    base_version: int
    base_hash: str
    version: int  # base_version + 1 when the step trained, else base_version
    checkpoint_hash: str
    batches: list[StepBatch]
    settings: StepSettings
    stale: list[StepBatch] = []
    no_signal: str = ""  # why nothing trained ("all_zero", ...); empty when the step trained
    dropped: list[DroppedBatch] = []
    state: StepState | None = None  # set when a checkpoint follows the step (module docstring)

    @property
    def trained(self) -> bool:
        return self.version == self.base_version + 1


def _check_batch(b: StepBatch, *, stale: bool) -> None:
    validate_cid(b.cid)
    if not 0 < len(b.worker) <= MAX_PEER_ID_LEN:
        raise ProtocolError("a batch's worker must be a peer ID of 1 to 128 characters")
    if not 0 <= b.groups <= MAX_BATCH_GROUPS:
        raise ProtocolError(f"a batch of {b.groups} groups, at most {MAX_BATCH_GROUPS}")
    if stale and (b.trained or b.evidence):
        raise ProtocolError("a stale batch has no trained groups and no evidence")
    if len(b.evidence) > 64 or any(not 0 < len(e) <= MAX_EVIDENCE_ENVELOPE for e in b.evidence):
        raise ProtocolError(f"batch {b.cid[:20]}: at most 64 evidence envelopes (run.verdict_quorum's bound) "
                            f"of 1 to {MAX_EVIDENCE_ENVELOPE} bytes")
    if b.trained != sorted(set(b.trained)) or any(not 0 <= i < b.groups for i in b.trained):
        raise ProtocolError(f"batch {b.cid[:20]}: trained group indices must be distinct, ascending and "
                            f"below its {b.groups} groups")


def check_record(rec: StepRecord) -> StepRecord:
    """Raise ProtocolError unless the record is internally consistent."""
    validate_run_id(rec.run_id)
    if not 0 < rec.seq < _MAX_VERSION or not 0 <= rec.step < _MAX_VERSION:
        raise ProtocolError("seq or step out of range")
    if not 0 <= rec.base_version < _MAX_VERSION \
            or rec.version not in (rec.base_version, rec.base_version + 1):
        raise ProtocolError(f"version {rec.version} does not follow base version {rec.base_version}")
    validate_cid(rec.base_hash)
    validate_cid(rec.checkpoint_hash)
    n = len(rec.batches) + len(rec.stale) + len(rec.dropped)
    if n > MAX_STEP_BATCHES:
        raise ProtocolError(f"{n} batches, at most {MAX_STEP_BATCHES}")
    cids = [b.cid for b in (*rec.batches, *rec.stale)] + [d.cid for d in rec.dropped]
    if len(set(cids)) != len(cids):
        raise ProtocolError("a batch is named twice")
    for b in rec.batches:
        _check_batch(b, stale=False)
    for b in rec.stale:
        _check_batch(b, stale=True)
    if sum(len(e) for b in rec.batches for e in b.evidence) > MAX_EVIDENCE_BYTES:
        raise ProtocolError(f"more than {MAX_EVIDENCE_BYTES} bytes of evidence")
    for d in rec.dropped:
        validate_cid(d.cid)
        if not 0 < len(d.worker) <= MAX_PEER_ID_LEN or d.reason not in DROP_REASONS:
            raise ProtocolError(f"dropped batch {d.cid[:20]}: a worker of 1 to {MAX_PEER_ID_LEN} characters "
                                f"and a reason of {DROP_REASONS}")
    if rec.no_signal not in NO_SIGNAL_CAUSES:
        raise ProtocolError(f"no_signal {rec.no_signal[:20]!r} is not one of {NO_SIGNAL_CAUSES}")
    any_trained = any(b.trained for b in rec.batches)
    if rec.trained != any_trained or rec.trained == bool(rec.no_signal):
        raise ProtocolError("a record trains exactly when it names trained groups and no no_signal cause")
    if not rec.trained and rec.checkpoint_hash != rec.base_hash:
        raise ProtocolError("a step that trained nothing keeps its base policy")
    if rec.state is not None:
        if not rec.trained:
            raise ProtocolError("only a step that trained is followed by a checkpoint")
        for cid in (rec.state.weights_cid, rec.state.optimizer_cid, rec.state.optimizer_hash):
            validate_cid(cid)
    s = rec.settings
    if (s.compute_dtype is not None and s.compute_dtype not in COMPUTE_DTYPES) or s.group_size < 2 \
            or s.token_budget < 1 or (s.micro_tokens is not None and s.micro_tokens < 1) \
            or s.loss not in LOSSES or not s.lr_scale > 0 or s.warmup_steps < 0:
        raise ProtocolError("step settings out of range")
    return rec


def seal_record(key: SigningKey, rec: StepRecord) -> bytes:
    """The signed envelope bytes the trainer publishes (and stores as the record's blob)."""
    check_record(rec)
    return key.seal(STEP_DOMAIN, rec)


def open_record(data: bytes, *, run_id: str, trainer: str) -> StepRecord:
    """Decode, verify and check a record: signed by ``trainer``, for ``run_id``, consistent."""
    return check_record(open_from_trainer(data, STEP_DOMAIN, StepRecord, max_size=MAX_RECORD_BYTES,
                                          run_id=run_id, trainer=trainer, what="step record"))


def record_validator(run_id: str, trainer: str) -> Callable[[bytes, str], StepRecord]:
    """A gossip validator ``(bytes, from_peer) -> StepRecord`` for ``swarm.subscribe``."""

    def validate(data: bytes, from_peer: str) -> StepRecord:
        return open_record(data, run_id=run_id, trainer=trainer)

    return validate
