"""The validator's check of rollout records: :class:`Verifier` and :func:`verify_rollout`.

Cheap checks first (structure, signature, run, policy version and checkpoint, dtype, sampling settings,
the prompt against the task, termination, reward), the reward scored in the caller's scoring lane
(``envs/sandbox.Lane``), whose meter refuses what is past the sender's budget as ``scoring_budget``.
Then one batched prefill of prompt + completion on the policy the run names, which yields the hidden
states and logits behind every completion token, and the three tensor checks of ``proofs/``: TOPLOC
against the committed top-k, the claimed logprobs against the recomputed ones, and the claimed tokens
against the seeded Gumbel-max sampler. TOPLOC alone misses a single edited token on a small model (see
the notes); the sampler check does not.

A verdict is ``accepted`` or carries one machine-readable ``reason`` from :data:`REASONS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import torch

from intellect_node.envs.sandbox import Lane, scoring_in
from intellect_node.envs.tasks import Problem, resolve_problem
from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.proofs.sampling import (
    SamplingCheck,
    batch_seeds,
    check_sampling_many,
    derived_rollout_id,
    rollout_key,
)
from intellect_node.proofs.thresholds import Thresholds
from intellect_node.proofs.toploc import ChunkResult, verify_proofs_batch
from intellect_node.protocol.rollout import RolloutRecord, check_record, verify_rollout_signature

REASONS = {
    "malformed": "the record breaks a structural rule (lengths, ranges, proof count)",
    "bad_signature": "the signature is not the named worker's over the record",
    "wrong_run": "the record is for another run",
    "policy_version": "the policy version is not the one being verified",
    "checkpoint": "the checkpoint CID is not the policy version's",
    "dtype": "the record was generated in another dtype than the run's",
    "sampling_params": "temperature, top-p or max_new_tokens differ from the run's",
    "unknown_task": "the task or problem ID does not resolve",
    "prompt_mismatch": "the prompt tokens are not the problem's prompt",
    "termination": "the completion continues past an EOS token or stops early without one",
    "reward": "the claimed reward is not the checker's score of the completion",
    "reward_unjudged": "the checker ran out of time on this node (not held against the worker)",
    "scoring_budget": "the batch's answers used up the scoring time or the timeouts allowed to it",
    "seed": "a sampling seed or rollout ID is not the one the run derives (proofs/sampling.group_seed)",
    "toploc": "the TOPLOC proofs do not match the recomputed hidden states",
    "logprob": "the claimed logprobs differ from the recomputed ones",
    "sampling": "the tokens are not what the seeded sampler draws from the recomputed logits",
}


def seed_violation(records: Sequence[RolloutRecord], run_id: str, policy_version: int, worker: str) -> str:
    """Why a batch's seeds are not the ones the run derives (empty if they are). Seeds are derived, not
    chosen, so a worker cannot resample a problem and keep the luckiest draws (``proofs/sampling.py``)."""
    seeds = batch_seeds(run_id, policy_version, worker, [r.problem_id for r in records])
    for r, want in zip(records, seeds):
        if r.sampling.seed != want or r.rollout_id != derived_rollout_id(worker, want):
            return (f"rollout {r.rollout_id} of {r.problem_id}: seed {r.sampling.seed} is not the derived "
                    f"{want}")
    return ""


@dataclass(frozen=True)
class Verdict:
    rollout_id: str
    worker: str
    accepted: bool
    reason: str | None = None
    detail: str = ""
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Expectations:
    """What the run prescribes; ``None`` fields are not checked."""

    run_id: str | None = None
    policy_version: int | None = None
    checkpoint_cid: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None


class Verifier:
    def __init__(self, engine: TorchEngine, thresholds: Thresholds, expect: Expectations = Expectations(), *,
                 resolve: Callable[[str], Problem] = resolve_problem, max_batch: int = 32) -> None:
        self.engine = engine
        self.tokenizer = engine.loaded.tokenizer
        self.thresholds = thresholds
        self.expect = expect
        self.resolve = resolve
        self.max_batch = max_batch

    def verify(self, records: Sequence[RolloutRecord], *, tensor_checks: Collection[int] | None = None,
               scoring: Lane | None = None) -> list[Verdict]:
        """One verdict per record, in order. The cheap checks run on every record; the tensor checks (a
        batched prefill per ``max_batch`` records) on those that pass them and, when ``tensor_checks`` is
        given, whose index is in it: the others are accepted on the cheap checks alone (a validator that
        samples a fraction of a batch's groups, ``rl.verify_fraction``). Rewards are scored in
        ``scoring`` (the sender's pool and budget; None: the process's default pool, no budget): once its
        meter is spent, the records left are refused ``scoring_budget`` without being scored."""
        with scoring_in(scoring):
            verdicts: list[Verdict | None] = [self._cheap(r, scoring) for r in records]
        todo = [i for i, v in enumerate(verdicts)
                if v is None and (tensor_checks is None or i in tensor_checks)]
        for start in range(0, len(todo), self.max_batch):
            idx = todo[start:start + self.max_batch]
            for i, v in zip(idx, self.verify_tensors([records[i] for i in idx])):
                verdicts[i] = v
        return [v if v is not None else Verdict(r.rollout_id, r.worker, True)
                for v, r in zip(verdicts, records)]

    def _reject(self, r: RolloutRecord, reason: str, detail: str,
                figures: dict[str, float] | None = None) -> Verdict:
        return Verdict(r.rollout_id, r.worker, False, reason, detail, figures or {})

    def _cheap(self, r: RolloutRecord, scoring: Lane | None = None) -> Verdict | None:
        try:
            check_record(r)
        except ProtocolError as exc:
            return self._reject(r, "malformed", str(exc))
        vocab = self.engine.runner.vocab_size
        if max(r.prompt_tokens + r.completion_tokens) >= vocab:
            return self._reject(r, "malformed", f"token ID >= vocabulary size {vocab}")
        try:
            verify_rollout_signature(r)
        except ProtocolError as exc:
            return self._reject(r, "bad_signature", str(exc))
        e = self.expect
        if e.run_id is not None and r.run_id != e.run_id:
            return self._reject(r, "wrong_run", f"run {r.run_id!r}, expected {e.run_id!r}")
        if e.policy_version is not None and r.policy_version != e.policy_version:
            return self._reject(r, "policy_version",
                                f"version {r.policy_version}, expected {e.policy_version}")
        if e.checkpoint_cid is not None and r.checkpoint_cid != e.checkpoint_cid:
            return self._reject(r, "checkpoint",
                                f"checkpoint {r.checkpoint_cid}, expected {e.checkpoint_cid}")
        if r.dtype != self.engine.dtype:
            return self._reject(r, "dtype", f"dtype {r.dtype}, run uses {self.engine.dtype}")
        s = r.sampling
        for name in ("temperature", "top_p", "max_new_tokens"):
            want = getattr(e, name)
            if want is not None and getattr(s, name) != want:
                return self._reject(r, "sampling_params", f"{name} {getattr(s, name)}, expected {want}")
        try:
            problem = self.resolve(r.problem_id)
        except ConfigError as exc:
            return self._reject(r, "unknown_task", str(exc))
        if problem.task_id != r.task_id:
            return self._reject(r, "unknown_task", f"problem {r.problem_id} is not in task {r.task_id}")
        if r.prompt_tokens != self.tokenizer.prompt_ids(problem.prompt, system=problem.system or None):
            return self._reject(r, "prompt_mismatch", f"prompt tokens differ from {r.problem_id}'s prompt")
        eos = self.tokenizer.eos_ids  # any of the model's EOS IDs ends a completion
        out = r.completion_tokens
        if any(t in eos for t in out[:-1]) or (out[-1] not in eos and len(out) != s.max_new_tokens):
            return self._reject(r, "termination", "tokens after an EOS token, or stopped before "
                                "max_new_tokens without one")
        judged = problem.judge(self.tokenizer.decode(out))
        if judged.reason == "budget":  # whatever the claim: this record was not scored
            spent = scoring.meter.spent if scoring is not None and scoring.meter is not None else ""
            return self._reject(r, "scoring_budget", f"not scored: {spent or 'the scoring budget is spent'}")
        if not math.isclose(judged.reward, r.reward, abs_tol=1e-9):
            if judged.reason == "timeout":  # this node's checker ran out of time: no evidence either way
                return self._reject(r, "reward_unjudged", f"claimed {r.reward}; the checker timed out here")
            return self._reject(r, "reward", f"claimed {r.reward}, checker gives {judged.reward}"
                                + (f" ({judged.reason})" if judged.reason else ""))
        return None

    def verify_tensors(self, records: list[RolloutRecord]) -> list[Verdict]:
        """Only the prefill-based checks (TOPLOC, logprobs, sampler) on records that passed the cheap
        ones; :meth:`verify` calls it in batches of ``max_batch``. Benchmarks time it directly."""
        hidden = self.engine.prefill_hidden([(r.prompt_tokens, r.completion_tokens) for r in records])
        states = [h.float().cpu() for h in hidden]
        toploc: list[list[ChunkResult] | ProtocolError]
        try:
            toploc = list(verify_proofs_batch(states, [r.proofs for r in records]))
        except ProtocolError:  # a malformed proof somewhere: one by one, so only its record is rejected
            toploc = []
            for h, r in zip(states, records):
                try:
                    toploc.extend(verify_proofs_batch([h], [r.proofs]))
                except ProtocolError as exc:
                    toploc.append(exc)
        th = self.thresholds
        sampled = self._sampling_checks(records, hidden)
        verdicts = []
        for r, sc, chunks in zip(records, sampled, toploc):
            if isinstance(chunks, ProtocolError):
                verdicts.append(self._reject(r, "malformed", str(chunks)))
                continue
            figs = {"exp_mismatches": float(max(c.exp_mismatches for c in chunks)),
                    "mant_err_mean": max(c.mant_err_mean for c in chunks),
                    "mant_err_median": max(c.mant_err_median for c in chunks)}
            figs.update(logprob_diff=sc.max_logprob_diff, sampling_gap=sc.max_gap)
            if (figs["exp_mismatches"] > th.exp_mismatches or figs["mant_err_mean"] > th.mant_err_mean
                    or figs["mant_err_median"] > th.mant_err_median):
                verdicts.append(self._reject(r, "toploc", _fmt(figs, "exp_mismatches", "mant_err_mean",
                                                               "mant_err_median"), figs))
            elif sc.max_logprob_diff > th.logprob_diff:
                verdicts.append(self._reject(r, "logprob", f"max |diff| {sc.max_logprob_diff:.3g} at token "
                                             f"{sc.worst_position}", figs))
            elif sc.max_gap > th.sampling_gap:
                verdicts.append(self._reject(r, "sampling", f"gap {sc.max_gap:.3g} at token "
                                             f"{sc.worst_position}", figs))
            else:
                verdicts.append(Verdict(r.rollout_id, r.worker, True, None, "", figs))
        return verdicts

    def _sampling_checks(self, records: Sequence[RolloutRecord],
                         hidden: Sequence[torch.Tensor]) -> list[SamplingCheck]:
        """The sampler re-run for each record, records of one (temperature, top-p) together, in slices
        of about :data:`CHECK_ROWS` tokens whose logits are computed, checked and dropped in turn."""
        by_params: dict[tuple[float, float], list[int]] = {}
        for i, r in enumerate(records):
            by_params.setdefault((r.sampling.temperature, r.sampling.top_p), []).append(i)
        out: list[SamplingCheck | None] = [None] * len(records)
        for (temperature, top_p), idx in by_params.items():
            for part in _slices(idx, [len(records[i].completion_tokens) for i in idx], CHECK_ROWS):
                rs = [records[i] for i in part]
                checks = check_sampling_many(self.engine.logits_of([hidden[i] for i in part]),
                                             [torch.tensor(r.completion_tokens) for r in rs],
                                             [torch.tensor(r.logprobs) for r in rs],
                                             [rollout_key(r.sampling.seed, r.rollout_id) for r in rs],
                                             temperature, top_p)
                for i, sc in zip(part, checks):
                    out[i] = sc
        return [sc for sc in out if sc is not None]


CHECK_ROWS = 512
"""Tokens whose logits the sampler check holds at once: 512 x a 49k vocabulary is 100 MB of float32,
where a whole batch (32 x 128 tokens) would be 0.8 GB per intermediate. The figures do not depend on
it (every operation of the check is per token)."""


def _slices(idx: list[int], lengths: list[int], rows: int) -> list[list[int]]:
    """``idx`` cut into consecutive runs of about ``rows`` tokens (a longer record gets a run of its own)."""
    out: list[list[int]] = [[]]
    total = 0
    for i, n in zip(idx, lengths):
        if out[-1] and total + n > rows:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _fmt(figs: dict[str, float], *names: str) -> str:
    return ", ".join(f"{n} {figs[n]:.3g}" for n in names)


def verify_rollout(record: RolloutRecord, verifier: Verifier) -> Verdict:
    """Verify one record (the validator role batches with :meth:`Verifier.verify` instead)."""
    return verifier.verify([record])[0]
