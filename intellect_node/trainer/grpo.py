"""The GRPO objective with the INTELLECT-2 changes (arXiv 2505.07291), as pure tensor functions.

For a prompt, the policy samples a *group* of G completions; each gets a verifiable reward r_i. The
advantage of every token of completion i is the group-relative reward A_i = r_i - mean(r) (no critic).
Per completion token t with ratio rho = pi_theta(tok) / pi_old(tok) (pi_old: the policy that sampled it):

    A >= 0:  l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)          (PPO clip)
    A <  0:  l = -min(min(rho, delta) * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)

The second line is INTELLECT-2's two-sided clipping: with a negative advantage plain PPO leaves the
unclipped term rho * A unbounded below when rho grows (a stale, off-policy token whose probability shot
up), which made their training unstable; capping rho at delta bounds that term and its gradient.

The loss is token-level and divided by a *constant* token budget (tokens per step the trainer admits,
e.g. samples x max completion tokens), not by the number of tokens actually present, so a long
completion is not down-weighted and the step size does not depend on how long the batch happened to be
(Dr. GRPO, arXiv 2503.20783; INTELLECT-2 follows it). Because the normaliser is a constant the loss is
a plain sum over tokens, which is what lets the step be split across micro-batches and DDP ranks
exactly (see ``step.py`` and ``distributed.py``).

``rl.loss`` chooses the per-token objective: the one above (``grpo``, the default) or one of the
off-policy corrections of ``losses.py``; the KL and entropy terms below apply to each alike.

Shortcuts: no std normalisation of advantages by default (Dr. GRPO argues it biases toward too-easy
and too-hard questions; ``scale_by_std`` turns it on); the KL term uses the k3 estimator
exp(q - p) - (q - p) - 1 per sampled token rather than an exact KL over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from intellect_node.errors import ConfigError
from intellect_node.trainer.losses import (
    IS_CAP,
    LOG_RATIO_TAU,
    LOSSES,
    PROB_DIFF_MASK,
    TokenTerms,
    grpo_terms,
    intellect2_terms,
    mis_terms,
    prime_terms,
)

GROUP_SIZE = 16
"""Completions sampled per prompt. INTELLECT-2 (arXiv 2505.07291) samples 16 per problem."""

CLIP_EPS = 0.2
"""Ratio clip on both sides, 1 - 0.2 .. 1 + 0.2. INTELLECT-2 uses epsilon 0.2 (two-sided GRPO clipping)."""

NEG_RATIO_CAP = 4.0
"""delta, the upper bound on the ratio for tokens with a negative advantage. INTELLECT-2: delta = 4."""

MAX_GRAD_NORM = 0.1
"""Gradient-norm clipping threshold. INTELLECT-2 reports that aggressive clipping (thresholds as low as
0.05-0.1) kept gradient norms from escalating over a long run; we take the upper end."""

LOG_RATIO_BOUND = 20.0
"""|log pi_theta - log pi_old| is clamped to this before ``exp``. The old log-probabilities come from the
worker's record: an honest one is within a few nats of the trainer's, but a forged -89 would make
exp(89) overflow fp32, and 0 * inf in the backward pass turns every weight into NaN. At e^20 the ratio is
far past the clip and the delta cap, so the clamp changes no honest token's loss or gradient."""

ASYNC_LEVEL = 2
"""Rollouts may come from a policy at most this many versions behind the one being trained.
INTELLECT-2 ran with async level 2 (two-step asynchrony) and saw no loss in quality."""


@dataclass(frozen=True)
class GRPOConfig:
    """Hyperparameters of the objective. Every default follows INTELLECT-2 unless said otherwise."""

    group_size: int = GROUP_SIZE
    clip_eps_low: float = CLIP_EPS
    clip_eps_high: float = CLIP_EPS
    neg_ratio_cap: float = NEG_RATIO_CAP
    max_grad_norm: float = MAX_GRAD_NORM
    token_budget: int = 16 * 64 * 8
    """The constant the token-level loss sum is divided by (tokens per step the trainer admits)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty against a reference policy. Off: INTELLECT-2 trained without it."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus. Off by default (INTELLECT-2 used none)."""
    scale_by_std: bool = False
    """Divide advantages by the group's std (original GRPO). Off: Dr. GRPO / mean-centred advantages."""
    loss: str = "grpo"
    """The per-token objective, one of ``losses.LOSSES`` (``losses.py``)."""
    is_cap: float = IS_CAP
    """``intellect2``'s staleness-weight truncation, ``mis``'s ratio band [1/cap, cap]."""
    prob_diff_mask: float = PROB_DIFF_MASK
    """``prime``: the probability change past which a token is masked."""
    log_ratio_tau: float = LOG_RATIO_TAU
    """``prime``: the weight of (log ratio)^2."""

    def __post_init__(self) -> None:
        checks = [
            ("group_size", self.group_size >= 2, "at least 2 (advantages are relative within a group)"),
            ("clip_eps_low", 0.0 < self.clip_eps_low < 1.0, "in (0, 1)"),
            ("clip_eps_high", self.clip_eps_high > 0.0, "positive"),
            ("neg_ratio_cap", self.neg_ratio_cap > 1.0 + self.clip_eps_high,
             "above 1 + clip_eps_high (INTELLECT-2 uses 4)"),
            ("max_grad_norm", self.max_grad_norm > 0.0, "positive"),
            ("token_budget", self.token_budget >= 1, "a positive number of tokens"),
            ("kl_coef", self.kl_coef >= 0.0, "zero or positive"),
            ("entropy_coef", self.entropy_coef >= 0.0, "zero or positive"),
            ("loss", self.loss in LOSSES, f"one of {', '.join(LOSSES)}"),
            ("is_cap", self.is_cap > 1.0, "above 1"),
            ("prob_diff_mask", 0.0 < self.prob_diff_mask <= 1.0, "in (0, 1]"),
            ("log_ratio_tau", self.log_ratio_tau >= 0.0, "zero or positive"),
        ]
        for name, ok, need in checks:
            if not ok:
                raise ConfigError(f"grpo.{name} = {getattr(self, name)!r} must be {need}", field=name)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages of a flat ``[n_groups * group_size]`` reward vector, same shape.

    Consecutive ``group_size`` entries are one prompt's completions.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.to(torch.float32).view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (groups.std(dim=1, keepdim=True, unbiased=True) + eps)
    return adv.reshape(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(target) for ``logits [B, T, V]`` and ``targets [B, T]``, computed in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, ``[B, T]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


@dataclass(frozen=True)
class LossParts:
    """The loss (a scalar tensor with grad) and detached diagnostics."""

    loss: torch.Tensor
    policy_loss: float
    tokens: int
    clipped_frac: float
    """Fraction of completion tokens the objective cut: whose gradient the clip, the delta cap or a mask
    removed, or whose weight ``intellect2``'s cap truncated."""
    ratio_mean: float
    """pi_theta / pi_sampler over the completion tokens, whatever the objective's own ratio."""
    ratio_max: float
    kl: float
    entropy: float
    kl_sampler: float = 0.0
    """Mean per token of KL(sampler || current), the k3 estimate rho - 1 - log rho on the sampled tokens."""
    neg_logp: float = 0.0
    """Mean per token of -log pi_theta(token): the current policy's entropy estimated on the samples."""


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: GRPOConfig, *, ref_logprobs: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None) -> LossParts:
    """The INTELLECT-2 GRPO loss over ``[B, T]`` token tensors.

    ``advantages`` is ``[B]`` (one per completion) or ``[B, T]``; ``mask`` is 1 on completion tokens.
    The result is a *sum* over masked tokens divided by ``cfg.token_budget``.
    """
    mask_f = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(logprobs)
    terms = policy_terms(logprobs, old_logprobs, adv, mask.bool(), cfg)
    policy_sum = (terms.per_token * mask_f).sum()
    loss = policy_sum / cfg.token_budget

    kl_val = 0.0
    if cfg.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        d = torch.where(mask.bool(), ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = torch.exp(d) - d - 1.0
        kl_sum = (kl * mask_f).sum()
        loss = loss + cfg.kl_coef * kl_sum / cfg.token_budget
        kl_val = float(kl_sum.detach())
    ent_val = 0.0
    if cfg.entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        ent_sum = (entropy * mask_f).sum()
        loss = loss - cfg.entropy_coef * ent_sum / cfg.token_budget
        ent_val = float(ent_sum.detach())

    with torch.no_grad():
        n = int(mask_f.sum().item())
        on = mask.bool()
        log_ratio = torch.where(on, logprobs - old_logprobs, torch.zeros_like(logprobs))
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        clipped_frac = float((terms.cut.to(mask_f.dtype) * mask_f).sum() / max(n, 1))
        rm = ratio[on]
        ratio_mean = float(rm.mean()) if n else 1.0
        ratio_max = float(rm.max()) if n else 1.0
        k3 = ratio - 1.0 - log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        kl_sampler = float((k3 * mask_f).sum() / max(n, 1))
        neg_logp = float((-logprobs.detach() * mask_f).sum() / max(n, 1))
    return LossParts(loss=loss, policy_loss=float(policy_sum.detach()) / cfg.token_budget, tokens=n,
                     clipped_frac=clipped_frac, ratio_mean=ratio_mean, ratio_max=ratio_max,
                     kl=kl_val, entropy=ent_val, kl_sampler=kl_sampler, neg_logp=neg_logp)


def policy_terms(logprobs: torch.Tensor, sampler: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 cfg: GRPOConfig) -> TokenTerms:
    """The per-token objective ``cfg.loss`` names (``losses.py``), ``[B, T]``."""
    bound = LOG_RATIO_BOUND
    if cfg.loss == "intellect2":
        return intellect2_terms(logprobs, sampler, adv, mask, eps_low=cfg.clip_eps_low,
                                eps_high=cfg.clip_eps_high, neg_cap=cfg.neg_ratio_cap, is_cap=cfg.is_cap,
                                bound=bound)
    if cfg.loss == "prime":
        return prime_terms(logprobs, sampler, adv, mask, prob_diff=cfg.prob_diff_mask, tau=cfg.log_ratio_tau,
                           bound=bound)
    if cfg.loss == "mis":
        return mis_terms(logprobs, sampler, adv, mask, is_cap=cfg.is_cap, bound=bound)
    return grpo_terms(logprobs, sampler, adv, mask, eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                      neg_cap=cfg.neg_ratio_cap, bound=bound)
