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

Shortcuts: sequences are right-padded to the longest in the micro-batch with explicit position IDs; no
packing; micro-batches keep the batch order (no sorting by length). One optimizer step per batch (no
PPO epochs): with ``async_level`` staleness the ratio already differs from 1 and INTELLECT-2 also
takes one step per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from intellect_node.trainer.grpo import (
    GRPOConfig,
    LossParts,
    group_advantages,
    grpo_loss,
    token_entropy,
    token_logprobs,
)
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
    extra: dict[str, float] = field(default_factory=dict)


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


def shifted_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for logits at t: the token at t+1 (the last column gets a dummy 0, always masked)."""
    return torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)


def _forward_logits(model: Any, tb: TensorBatch) -> torch.Tensor:
    out = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=tb.position_ids)
    return out.logits if hasattr(out, "logits") else out


def batch_advantages(samples: Sequence[Sample], cfg: GRPOConfig) -> torch.Tensor:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return group_advantages(rewards, cfg.group_size, scale_by_std=cfg.scale_by_std)


def micro_batches(samples: Sequence[Sample], *, micro_batch: int = 64,
                  micro_tokens: int | None = None) -> list[range]:
    """Consecutive index ranges of ``samples``: at most ``micro_batch`` rows and, when given, at most
    ``micro_tokens`` padded tokens (rows x longest row) each. A row longer than the budget alone is a
    micro-batch of its own (it cannot be split: its tokens attend to each other)."""
    if micro_batch < 1 or (micro_tokens is not None and micro_tokens < 1):
        raise ValueError(f"micro_batch {micro_batch} and micro_tokens {micro_tokens} must be positive")
    out: list[range] = []
    start, width = 0, 0
    for i, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.completion_ids)
        rows = i - start
        w = max(width, n)
        over = rows >= micro_batch or (micro_tokens is not None and (rows + 1) * w > micro_tokens)
        if rows and over:
            out.append(range(start, i))
            start, w = i, n
        width = w
    if start < len(samples):
        out.append(range(start, len(samples)))
    return out


def micro_step(model: Any, samples: Sequence[Sample], advantages: torch.Tensor, cfg: GRPOConfig, *,
               pad_id: int = 0, ref_model: Any | None = None, loss_scale: float = 1.0,
               temperature: float = 1.0, compute_dtype: torch.dtype | None = None) -> LossParts:
    """Forward and backward one micro-batch, adding ``loss_scale`` x its loss gradient into ``.grad``.

    ``temperature`` is the one the samples were drawn at: pi_theta must be the same tempered
    distribution as pi_old. The loss itself is computed in fp32 whatever ``compute_dtype`` is.
    """
    device = model_device(model)
    tb = collate(samples, advantages, pad_id).to(device)
    with autocast(device, compute_dtype):
        logits = _forward_logits(model, tb)
    if temperature != 1.0:
        logits = logits.float() / temperature
    targets = shifted_targets(tb.input_ids)
    logp = token_logprobs(logits, targets)
    ref_lp = None
    if cfg.kl_coef > 0.0:
        if ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        with torch.no_grad(), autocast(device, compute_dtype):
            ref_logits = _forward_logits(ref_model, tb)
        ref_lp = token_logprobs(ref_logits.float() / temperature, targets)
    ent = token_entropy(logits) if cfg.entropy_coef > 0.0 else None
    p = grpo_loss(logp, tb.old_logprobs, tb.advantages, tb.loss_mask, cfg, ref_logprobs=ref_lp, entropy=ent)
    (p.loss * loss_scale).backward()
    return p


def accumulate_gradients(model: Any, samples: Sequence[Sample], advantages: torch.Tensor, cfg: GRPOConfig,
                         *, micro_batch: int = 64, micro_tokens: int | None = None, pad_id: int = 0,
                         ref_model: Any | None = None, loss_scale: float = 1.0, temperature: float = 1.0,
                         compute_dtype: torch.dtype | None = None) -> list[LossParts]:
    """Forward/backward ``samples`` in micro-batches, adding into ``.grad``; returns per-micro-batch parts.

    ``loss_scale`` multiplies each backward (data-parallel wrappers average gradients over ranks; the
    caller passes the world size so the average becomes the sum the objective is defined as).
    """
    return [micro_step(model, [samples[i] for i in r], advantages[r.start:r.stop], cfg, pad_id=pad_id,
                       ref_model=ref_model, loss_scale=loss_scale, temperature=temperature,
                       compute_dtype=compute_dtype)
            for r in micro_batches(samples, micro_batch=micro_batch, micro_tokens=micro_tokens)]


def summarize(parts: Sequence[LossParts], samples: Sequence[Sample], grad_norm: float) -> StepStats:
    tokens = sum(p.tokens for p in parts)

    def weighted(attr: str) -> float:
        return sum(getattr(p, attr) * p.tokens for p in parts) / max(tokens, 1)

    return StepStats(
        loss=sum(float(p.loss.detach()) for p in parts), grad_norm=grad_norm, tokens=tokens,
        samples=len(samples), clipped_frac=weighted("clipped_frac"), ratio_mean=weighted("ratio_mean"),
        ratio_max=max((p.ratio_max for p in parts), default=1.0),
        reward_mean=sum(s.reward for s in samples) / max(len(samples), 1),
        kl=sum(p.kl for p in parts), entropy=sum(p.entropy for p in parts))


def train_step(model: Any, optimizer: Optimizer, samples: Sequence[Sample], cfg: GRPOConfig,
               *, micro_batch: int = 64, micro_tokens: int | None = None, pad_id: int = 0,
               ref_model: Any | None = None, temperature: float = 1.0,
               compute_dtype: torch.dtype | None = None) -> StepStats:
    """One GRPO optimizer step on ``samples`` (whole groups, consecutive). Returns the step's statistics."""
    if len(samples) % cfg.group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {cfg.group_size}")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    adv = batch_advantages(samples, cfg)
    parts = accumulate_gradients(model, samples, adv, cfg, micro_batch=micro_batch, micro_tokens=micro_tokens,
                                 pad_id=pad_id, ref_model=ref_model, temperature=temperature,
                                 compute_dtype=compute_dtype)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return summarize(parts, samples, grad_norm)


def make_optimizer(model: Any, lr: float, *, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), torch_optim: bool = False) -> Optimizer:
    """AdamW (the optimizer INTELLECT-2 trains with); torch's default betas, no weight decay by default.

    :class:`~intellect_node.trainer.optim.CpuAdamW` when every parameter is a plain CPU tensor (the same
    update as torch's, without its ``torch._dynamo`` import on the first step's path); ``torch.optim.AdamW``
    on GPUs, for sharded parameters, and when ``torch_optim`` asks for it (``trainer/distributed.py``)."""
    params = list(model.parameters())
    if not torch_optim and CpuAdamW.takes(params):
        return CpuAdamW(params, lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
