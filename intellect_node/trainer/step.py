"""One optimizer step of GRPO on a batch of scored completions.

A :class:`Sample` is one completion: the prompt and completion token IDs, the log-probabilities the
sampling policy gave each completion token (checked by validators, so the trainer can use them as
pi_old), the reward and the policy version that produced it. Samples come in groups of
``cfg.group_size`` consecutive entries per prompt.

The step: group advantages over the whole batch -> forward/backward in micro-batches (the loss is a
sum over tokens divided by a constant, so accumulating micro-batch gradients gives exactly the full-batch
gradient) -> clip the global gradient norm -> optimizer step. ``distributed.py`` runs the same function
on a shard per rank.

Shortcuts: sequences are right-padded to the longest in the micro-batch with explicit position IDs; no
packing. One optimizer step per batch (no PPO epochs): with ``async_level`` staleness the ratio already
differs from 1 and INTELLECT-2 also takes one step per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


def accumulate_gradients(model: Any, samples: Sequence[Sample], advantages: torch.Tensor, cfg: GRPOConfig,
                         *, micro_batch: int = 64, pad_id: int = 0, ref_model: Any | None = None,
                         loss_scale: float = 1.0, temperature: float = 1.0) -> list[LossParts]:
    """Forward/backward ``samples`` in micro-batches, adding into ``.grad``; returns per-micro-batch parts.

    ``loss_scale`` multiplies each backward (DDP averages gradients over ranks; the caller passes the
    world size so the average becomes the sum the objective is defined as). ``temperature`` is the one
    the samples were drawn at: pi_theta must be the same tempered distribution as pi_old.
    """
    parts: list[LossParts] = []
    for start in range(0, len(samples), micro_batch):
        chunk = samples[start:start + micro_batch]
        tb = collate(chunk, advantages[start:start + micro_batch], pad_id)
        logits = _forward_logits(model, tb)
        if temperature != 1.0:
            logits = logits / temperature
        targets = shifted_targets(tb.input_ids)
        logp = token_logprobs(logits, targets)
        ref_lp = None
        if cfg.kl_coef > 0.0:
            if ref_model is None:
                raise ValueError("kl_coef > 0 needs a reference model")
            with torch.no_grad():
                ref_lp = token_logprobs(_forward_logits(ref_model, tb) / temperature, targets)
        ent = token_entropy(logits) if cfg.entropy_coef > 0.0 else None
        p = grpo_loss(logp, tb.old_logprobs, tb.advantages, tb.loss_mask, cfg, ref_logprobs=ref_lp,
                      entropy=ent)
        (p.loss * loss_scale).backward()
        parts.append(p)
    return parts


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


def train_step(model: Any, optimizer: torch.optim.Optimizer, samples: Sequence[Sample], cfg: GRPOConfig,
               *, micro_batch: int = 64, pad_id: int = 0, ref_model: Any | None = None,
               temperature: float = 1.0) -> StepStats:
    """One GRPO optimizer step on ``samples`` (whole groups, consecutive). Returns the step's statistics."""
    if len(samples) % cfg.group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {cfg.group_size}")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    adv = batch_advantages(samples, cfg)
    parts = accumulate_gradients(model, samples, adv, cfg, micro_batch=micro_batch, pad_id=pad_id,
                                 ref_model=ref_model, temperature=temperature)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return summarize(parts, samples, grad_norm)


def make_optimizer(model: Any, lr: float, *, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW (the optimizer INTELLECT-2 trains with); torch's default betas, no weight decay by default."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
