"""One optimizer step of GRPO on a batch of scored completions.

A :class:`Sample` is one completion: the prompt and completion token IDs, the log-probabilities the
sampling policy gave each completion token (checked by validators, so the trainer can use them as
pi_old), the reward and the policy version that produced it. Samples come in groups of
``cfg.group_size`` consecutive entries per prompt.

The step: group advantages over the whole batch -> forward/backward in micro-batches (the loss is a
sum over tokens divided by a constant, so accumulating micro-batch gradients gives exactly the full-batch
gradient) -> clip the global gradient norm -> optimizer step. ``distributed.py`` runs the same
micro-steps on a shard per rank.

Micro-batches are cut by a token budget (``micro_tokens``: rows x longest row, padding included, which
is what the activations cost) and a row cap (``micro_batch``), so a batch of long completions takes more,
smaller forwards instead of running out of memory. The model may live on any device and compute under
autocast (``compute_dtype``, see ``trainer/model.py``); batches are built on the CPU and moved.

Shared prompts (:func:`pack_groups`): a group's completions all continue one prompt, so on the trainer's
own network (``trainer/lean.py``) each group is one row, the prompt once and then every completion, with
an attention mask that lets each completion see the prompt and its own earlier tokens only and position
IDs that restart after the prompt. Every completion token gets the logits it gets in its own padded row
(the same sums, up to float rounding), and the prompt is computed once per group instead of
``group_size`` times. For the embedded task (prompts of 8-14 tokens, completions of up to 5, groups of 8)
the forward and backward cover 3x fewer tokens. It is used where every packed row fits
:data:`PACK_ROW_LIMIT`: the mask is dense (row x row per group), so a group of long completions would
pay in attention what it saves in the prompt's share, and takes the padded layout.

Shortcuts: padded sequences are right-padded to the longest in the micro-batch with explicit position
IDs; micro-batches keep the batch order (no sorting by length). One optimizer step per batch (no
PPO epochs): with ``async_level`` staleness the ratio already differs from 1 and INTELLECT-2 also
takes one step per batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence, overload

import torch

from intellect_node.trainer.grpo import (
    GRPOConfig,
    LossParts,
    group_advantages,
    grpo_loss,
    token_entropy,
    token_logprobs,
)
from intellect_node.trainer.lean import LeanCausalLM
from intellect_node.trainer.model import autocast, model_device
from intellect_node.trainer.optim import CpuAdamW, Optimizer


@dataclass(frozen=True)
class Sample:
    """One scored completion."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    """log pi_old of each completion token, from the policy that sampled it."""
    reward: float
    policy_version: int = 0
    task_id: str = ""


@dataclass(frozen=True)
class StepStats:
    loss: float
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    samples: int
    clipped_frac: float
    ratio_mean: float
    ratio_max: float
    reward_mean: float
    kl: float = 0.0
    entropy: float = 0.0
    kl_sampler: float = 0.0
    """Mean per token of KL(sampler || weights before the step), ``grpo.LossParts.kl_sampler``."""
    neg_logp: float = 0.0
    """Mean per token of -log pi(token) before the step: the policy's entropy estimated on the samples."""
    lr: float = 0.0
    """The learning rate the step used (0: the optimizer's own, not set by the caller)."""
    extra: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    """The loss or the gradient was not finite: no optimizer step was taken, the weights are unchanged."""


@dataclass(frozen=True)
class TensorBatch:
    input_ids: torch.Tensor       # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor    # [B, T] long
    loss_mask: torch.Tensor       # [B, T] bool: position t predicts a completion token
    old_logprobs: torch.Tensor    # [B, T] fp32, aligned with loss_mask
    advantages: torch.Tensor      # [B] fp32

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> "TensorBatch":
        if torch.device(device).type == "cpu":
            return self
        return replace(self, **{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})


def collate(samples: Sequence[Sample], advantages: torch.Tensor, pad_id: int = 0) -> TensorBatch:
    """Right-pad ``samples`` into tensors aligned for next-token prediction.

    Position t of ``loss_mask``/``old_logprobs`` refers to the token at t+1 (predicted from logits at t),
    so the logits row used for a completion token is the one just before it.
    """
    if not samples:
        raise ValueError("empty batch")
    seqs = [list(s.prompt_ids) + list(s.completion_ids) for s in samples]
    width = max(len(x) for x in seqs)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    old = torch.zeros((b, width), dtype=torch.float32)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        if len(s.old_logprobs) != len(s.completion_ids):
            raise ValueError(f"sample {i}: {len(s.old_logprobs)} logprobs for {len(s.completion_ids)} tokens")
        if not s.prompt_ids:
            raise ValueError(f"sample {i}: empty prompt")
        input_ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, :len(seq)] = 1
        p, c = len(s.prompt_ids), len(s.completion_ids)
        loss_mask[i, p - 1:p - 1 + c] = True
        old[i, p - 1:p - 1 + c] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    position_ids = torch.arange(width).unsqueeze(0).expand(b, width).contiguous()
    return TensorBatch(input_ids, attn, position_ids, loss_mask, old, advantages.to(torch.float32))


PACK_ROW_LIMIT = 1024
"""Longest packed row (tokens) :func:`train_step` uses: the packed attention mask is dense, one
row x row boolean matrix per group, and a long row's attention costs more than sharing its prompt saves."""


@dataclass(frozen=True)
class PackedBatch:
    """Whole groups, one row each: the shared prompt, then every completion without its last token (only
    ever a target). Completion token k of a sample is predicted by the logits at ``(rows, slots)``: the
    prompt's last slot for k = 0, the slot of the completion's token k - 1 after it."""

    input_ids: torch.Tensor     # [G, W] long, right-padded
    position_ids: torch.Tensor  # [G, W] long: a completion's tokens continue the prompt's positions
    allowed: torch.Tensor       # [G, W, W] bool: the prompt causally; each completion, the prompt and itself
    rows: torch.Tensor          # [N] long, one entry per completion token of the batch
    slots: torch.Tensor         # [N] long
    targets: torch.Tensor       # [N] long
    old_logprobs: torch.Tensor  # [N] fp32
    advantages: torch.Tensor    # [N] fp32

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(*(t.to(device) for t in (self.input_ids, self.position_ids, self.allowed,
                                                    self.rows, self.slots, self.targets,
                                                    self.old_logprobs, self.advantages)))


def _groups(samples: Sequence[Sample], group_size: int) -> list[Sequence[Sample]]:
    return [samples[i:i + group_size] for i in range(0, len(samples), group_size)]


def packed_length(group: Sequence[Sample]) -> int:
    """Slots of ``group``'s packed row: the prompt, and each completion but its last token."""
    return len(group[0].prompt_ids) + sum(max(len(s.completion_ids) - 1, 0) for s in group)


def packable(samples: Sequence[Sample], group_size: int, *, limit: int = PACK_ROW_LIMIT) -> bool:
    """Whether :func:`pack_groups` applies to ``samples``: whole groups, one prompt per group, and every
    packed row within ``limit``. (Within it, packing always computes fewer slots than padding: a group of
    G takes its prompt once instead of G times, and no completion is padded to the longest.)"""
    if not samples or len(samples) % group_size:
        return False
    groups = _groups(samples, group_size)
    if any(s.prompt_ids != g[0].prompt_ids or not s.prompt_ids for g in groups for s in g):
        return False
    return max(packed_length(g) for g in groups) <= limit


def pack_groups(samples: Sequence[Sample], advantages: torch.Tensor, group_size: int,
                pad_id: int = 0) -> PackedBatch:
    """One row per group of ``group_size`` consecutive samples sharing a prompt (see :class:`PackedBatch`);
    ValueError for samples that are not whole groups with one prompt each."""
    if not samples or len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {group_size}")
    groups = _groups(samples, group_size)
    width = max(packed_length(g) for g in groups)
    n_groups = len(groups)
    input_ids = torch.full((n_groups, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n_groups, width), dtype=torch.long)
    segment = torch.full((n_groups, width), -2, dtype=torch.long)  # -1 the prompt, j completion j, -2 pad
    rows: list[int] = []
    slots: list[int] = []
    targets: list[int] = []
    old: list[float] = []
    adv: list[float] = []
    for g, group in enumerate(groups):
        prompt = group[0].prompt_ids
        p = len(prompt)
        if not p:
            raise ValueError(f"group {g}: empty prompt")
        row, pos = list(prompt), list(range(p))
        seg = [-1] * p
        for j, s in enumerate(group):
            if s.prompt_ids != prompt:
                raise ValueError(f"group {g}: sample {j} has another prompt than the group's first")
            c = s.completion_ids
            if len(s.old_logprobs) != len(c):
                raise ValueError(f"sample {g * group_size + j}: {len(s.old_logprobs)} logprobs for "
                                 f"{len(c)} tokens")
            start = len(row)
            for k, tok in enumerate(c):
                rows.append(g)
                slots.append(p - 1 if k == 0 else start + k - 1)
                targets.append(tok)
            old.extend(s.old_logprobs)
            adv.extend([float(advantages[g * group_size + j])] * len(c))
            row.extend(c[:-1])
            pos.extend(range(p, p + len(c) - 1))
            seg.extend([j] * max(len(c) - 1, 0))
        input_ids[g, :len(row)] = torch.tensor(row, dtype=torch.long)
        position_ids[g, :len(row)] = torch.tensor(pos, dtype=torch.long)
        segment[g, :len(row)] = torch.tensor(seg, dtype=torch.long)
    slot = torch.arange(width)
    causal = slot.view(1, width, 1) >= slot.view(1, 1, width)  # [1, q, k]
    seg_q, seg_k = segment.unsqueeze(2), segment.unsqueeze(1)
    # A pad slot sees the prompt and the pads before it (never an empty row); no real slot sees a pad.
    allowed = causal & ((seg_k == -1) | (seg_k == seg_q))
    return PackedBatch(input_ids, position_ids, allowed, torch.tensor(rows, dtype=torch.long),
                       torch.tensor(slots, dtype=torch.long), torch.tensor(targets, dtype=torch.long),
                       torch.tensor(old, dtype=torch.float32), torch.tensor(adv, dtype=torch.float32))


def shifted_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for logits at t: the token at t+1 (the last column gets a dummy 0, always masked)."""
    return torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)


def _forward_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**inputs)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out
    return logits


def batch_advantages(samples: Sequence[Sample], cfg: GRPOConfig) -> torch.Tensor:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return group_advantages(rewards, cfg.group_size, scale_by_std=cfg.scale_by_std)


def _cut(lengths: Sequence[int], max_rows: int, max_tokens: int | None) -> list[range]:
    """Consecutive index ranges of rows with these lengths: at most ``max_rows`` rows and, when given, at
    most ``max_tokens`` padded tokens (rows x longest row) each; a row over the budget alone is its own."""
    out: list[range] = []
    start, width = 0, 0
    for i, n in enumerate(lengths):
        rows = i - start
        w = max(width, n)
        over = rows >= max_rows or (max_tokens is not None and (rows + 1) * w > max_tokens)
        if rows and over:
            out.append(range(start, i))
            start, w = i, n
        width = w
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


def micro_batches(samples: Sequence[Sample], *, micro_batch: int = 64,
                  micro_tokens: int | None = None, group_size: int | None = None) -> list[range]:
    """Consecutive index ranges of ``samples``: at most ``micro_batch`` rows and, when given, at most
    ``micro_tokens`` padded tokens (rows x longest row) each. A row longer than the budget alone is a
    micro-batch of its own (it cannot be split: its tokens attend to each other).

    With ``group_size`` the samples are packed (:func:`pack_groups`): the rows are groups, the cuts fall
    between groups, and ``micro_batch`` still counts samples (at least one group per micro-batch)."""
    if micro_batch < 1 or (micro_tokens is not None and micro_tokens < 1):
        raise ValueError(f"micro_batch {micro_batch} and micro_tokens {micro_tokens} must be positive")
    if group_size is None:
        return _cut([len(s.prompt_ids) + len(s.completion_ids) for s in samples], micro_batch, micro_tokens)
    cuts = _cut([packed_length(g) for g in _groups(samples, group_size)], max(1, micro_batch // group_size),
                micro_tokens)
    return [range(r.start * group_size, r.stop * group_size) for r in cuts]


def micro_step(model: torch.nn.Module, samples: Sequence[Sample], advantages: torch.Tensor, cfg: GRPOConfig,
               *, pad_id: int = 0, ref_model: torch.nn.Module | None = None, loss_scale: float = 1.0,
               temperature: float = 1.0, compute_dtype: torch.dtype | None = None,
               packed: bool = False) -> LossParts:
    """Forward and backward one micro-batch, adding ``loss_scale`` x its loss gradient into ``.grad``.

    ``temperature`` is the one the samples were drawn at: pi_theta must be the same tempered
    distribution as pi_old. The loss itself is computed in fp32 whatever ``compute_dtype`` is.
    ``packed``: whole groups in :func:`pack_groups`' layout (the model, and the reference model, must
    take its ``allowed`` mask: ``trainer/lean.py``'s does).
    """
    device = model_device(model)
    if packed:
        pb = pack_groups(samples, advantages, cfg.group_size, pad_id).to(device)
        inputs: dict[str, torch.Tensor] = dict(input_ids=pb.input_ids, position_ids=pb.position_ids,
                                               allowed=pb.allowed)

        def at_targets(logits: torch.Tensor) -> torch.Tensor:  # [1, N, V]
            return logits[pb.rows, pb.slots].unsqueeze(0)

        targets, old = pb.targets.unsqueeze(0), pb.old_logprobs.unsqueeze(0)
        adv, mask = pb.advantages.unsqueeze(0), torch.ones_like(targets, dtype=torch.bool)
    else:
        tb = collate(samples, advantages, pad_id).to(device)
        inputs = dict(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=tb.position_ids)

        def at_targets(logits: torch.Tensor) -> torch.Tensor:
            return logits

        targets, old, adv, mask = shifted_targets(tb.input_ids), tb.old_logprobs, tb.advantages, tb.loss_mask
    with autocast(device, compute_dtype):
        logits = at_targets(_forward_logits(model, inputs))
    if temperature != 1.0:
        logits = logits.float() / temperature
    logp = token_logprobs(logits, targets)
    ref_lp = None
    if cfg.kl_coef > 0.0:
        if ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        with torch.no_grad(), autocast(device, compute_dtype):
            ref_logits = at_targets(_forward_logits(ref_model, inputs))
        ref_lp = token_logprobs(ref_logits.float() / temperature, targets)
    ent = token_entropy(logits) if cfg.entropy_coef > 0.0 else None
    p = grpo_loss(logp, old, adv, mask, cfg, ref_logprobs=ref_lp, entropy=ent)
    (p.loss * loss_scale).backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    return p


def accumulate_gradients(model: torch.nn.Module, samples: Sequence[Sample], advantages: torch.Tensor,
                         cfg: GRPOConfig, *, micro_batch: int = 64, micro_tokens: int | None = None,
                         pad_id: int = 0, ref_model: torch.nn.Module | None = None, loss_scale: float = 1.0,
                         temperature: float = 1.0, compute_dtype: torch.dtype | None = None,
                         packed: bool = False) -> list[LossParts]:
    """Forward/backward ``samples`` in micro-batches, adding into ``.grad``; returns per-micro-batch parts.

    ``loss_scale`` multiplies each backward (data-parallel wrappers average gradients over ranks; the
    caller passes the world size so the average becomes the sum the objective is defined as).
    ``packed``: in :func:`pack_groups`' layout, micro-batches of whole groups.
    """
    cuts = micro_batches(samples, micro_batch=micro_batch, micro_tokens=micro_tokens,
                         group_size=cfg.group_size if packed else None)
    return [micro_step(model, [samples[i] for i in r], advantages[r.start:r.stop], cfg, pad_id=pad_id,
                       ref_model=ref_model, loss_scale=loss_scale, temperature=temperature,
                       compute_dtype=compute_dtype, packed=packed)
            for r in cuts]


def summarize(parts: Sequence[LossParts], samples: Sequence[Sample], grad_norm: float) -> StepStats:
    tokens = sum(p.tokens for p in parts)

    def weighted(attr: str) -> float:
        return sum(float(getattr(p, attr)) * p.tokens for p in parts) / max(tokens, 1)

    return StepStats(
        loss=sum(float(p.loss.detach()) for p in parts), grad_norm=grad_norm, tokens=tokens,
        samples=len(samples), clipped_frac=weighted("clipped_frac"), ratio_mean=weighted("ratio_mean"),
        ratio_max=max((p.ratio_max for p in parts), default=1.0),
        reward_mean=sum(s.reward for s in samples) / max(len(samples), 1),
        kl=sum(p.kl for p in parts), entropy=sum(p.entropy for p in parts), kl_sampler=weighted("kl_sampler"),
        neg_logp=weighted("neg_logp"))


def takes_packed(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` computes :func:`pack_groups`' layout: the trainer's own network, not wrapped."""
    return isinstance(model, LeanCausalLM)


def finite_alone(model: torch.nn.Module, samples: Sequence[Sample], cfg: GRPOConfig, *,
                 micro_tokens: int | None = None, pad_id: int = 0, temperature: float = 1.0,
                 compute_dtype: torch.dtype | None = None) -> bool:
    """Whether the loss and gradient of ``samples`` (whole groups) alone are finite: what a step on them
    would compute, without its optimizer step; the gradients are cleared before and after. The trainer
    asks it of each batch of a step :func:`train_step` skipped, to find the batches behind it."""
    model.zero_grad(set_to_none=True)
    try:
        parts = accumulate_gradients(model, samples, batch_advantages(samples, cfg), cfg,
                                     micro_tokens=micro_tokens, pad_id=pad_id, temperature=temperature,
                                     compute_dtype=compute_dtype)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        return math.isfinite(norm) and math.isfinite(sum(float(p.loss.detach()) for p in parts))
    finally:
        model.zero_grad(set_to_none=True)


def train_step(model: torch.nn.Module, optimizer: Optimizer, samples: Sequence[Sample], cfg: GRPOConfig,
               *, micro_batch: int = 64, micro_tokens: int | None = None, pad_id: int = 0,
               ref_model: torch.nn.Module | None = None, temperature: float = 1.0,
               compute_dtype: torch.dtype | None = None, pack: bool = True,
               lr: float | None = None) -> StepStats:
    """One GRPO optimizer step on ``samples`` (whole groups, consecutive). Returns the step's statistics.

    ``lr``: the learning rate of this step (the schedule's, ``stepsize.py``), set on the optimizer before
    it steps; None keeps the optimizer's.

    ``pack``: share each group's prompt (:func:`pack_groups`) where the model takes that layout
    (:class:`~intellect_node.trainer.lean.LeanCausalLM`, and the reference model too when the KL term uses it)
    and :func:`packable` says the batch fits; otherwise, and with ``pack=False``, padded rows."""
    if len(samples) % cfg.group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {cfg.group_size}")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    adv = batch_advantages(samples, cfg)
    ref_used = ref_model is not None and cfg.kl_coef > 0.0
    packed = pack and takes_packed(model) and (not ref_used or takes_packed(ref_model)) \
        and packable(samples, cfg.group_size)
    parts = accumulate_gradients(model, samples, adv, cfg, micro_batch=micro_batch, micro_tokens=micro_tokens,
                                 pad_id=pad_id, ref_model=ref_model, temperature=temperature,
                                 compute_dtype=compute_dtype, packed=packed)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    loss = sum(float(p.loss.detach()) for p in parts)
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        # clip_grad_norm_ scales a NaN gradient into NaN, and AdamW would write it into every weight.
        optimizer.zero_grad(set_to_none=True)
        return replace(summarize(parts, samples, grad_norm), skipped=True)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return replace(summarize(parts, samples, grad_norm), lr=float(optimizer.param_groups[0]["lr"]))


@overload
def make_optimizer(model: torch.nn.Module, lr: float, *, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999),
                   torch_optim: Literal[True]) -> torch.optim.Optimizer: ...


@overload
def make_optimizer(model: torch.nn.Module, lr: float, *, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), torch_optim: bool = False) -> Optimizer: ...


def make_optimizer(model: torch.nn.Module, lr: float, *, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), torch_optim: bool = False) -> Optimizer:
    """AdamW (the optimizer INTELLECT-2 trains with); torch's default betas, no weight decay by default.

    :class:`~intellect_node.trainer.optim.CpuAdamW` when every parameter is a plain CPU tensor (the same
    update as torch's, without its ``torch._dynamo`` import on the first step's path); ``torch.optim.AdamW``
    on GPUs, for sharded parameters, and when ``torch_optim`` asks for it (``trainer/distributed.py``)."""
    params = list(model.parameters())
    if not torch_optim and CpuAdamW.takes(params):
        return CpuAdamW(params, lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
