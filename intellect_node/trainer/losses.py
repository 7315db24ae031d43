"""The per-token policy objectives ``rl.loss`` chooses between, as pure tensor functions.

Every variant reads the same three things per completion token: log pi_theta(tok) with its gradient
(``logp``), the log-probability the worker's sampling policy gave it (``sampler``: verified by the
validators, the behaviour policy) and the advantage ``A`` of its completion. With one optimizer step per
batch (``step.py``) the trainer's own log-probability before the update is ``logp`` itself, detached:
the forward that computes the loss runs on the weights the step starts from.

1. ``grpo`` (the default): PPO's clipped ratio rho = pi_theta / pi_sampler with INTELLECT-2's cap delta
   on negative advantages (``grpo.py``'s module docstring). The trust region is centred on the sampler,
   so on a stale batch the tokens the last steps already moved past 1 +- eps get no gradient.
2. ``intellect2``: the trust region is centred on the trainer's own log-probabilities before the update
   (what INTELLECT-2's code recomputes), and each token is weighted by the staleness ratio
   w = min(pi_old / pi_sampler, cap), detached (truncated importance sampling: an unbiased correction
   for the sampler up to the cap). With one step per batch the clipped ratio is 1 at the step's start,
   so every token keeps its gradient, scaled by w.
3. ``prime`` (prime-rl's current loss): the importance ratio rho against the sampler, unclipped, with
   the tokens whose probability moved more than ``prob_diff_mask`` in the advantage's direction
   (pi_theta - pi_sampler > 0.2 with A > 0, < -0.2 with A < 0) masked out, plus
   ``log_ratio_tau`` x (log rho)^2 on every token, a small pull toward the sampler.
4. ``mis``: masked importance sampling: tokens whose ratio rho lies outside [1/cap, cap] are masked,
   the others get -rho A (the importance-weighted policy gradient, unclipped).

Each returns :class:`TokenTerms`: the per-token loss (summed and divided by the constant token budget
by the caller) and which tokens the variant cut: removed the gradient of (clip, mask) or truncated the
weight of (``intellect2``'s cap). Log-ratios are clamped to +-``bound`` before ``exp`` (a forged sampler
log-probability cannot overflow fp32: ``grpo.LOG_RATIO_BOUND``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSSES = ("grpo", "intellect2", "prime", "mis")
"""The values of ``rl.loss``."""

IS_CAP = 2.0
"""The cap on the sampler importance ratio: ``intellect2`` truncates its staleness weight there, ``mis``
masks tokens whose ratio is outside [1/cap, cap]. 2 is the truncation TIS papers commonly run with (a
token whose probability doubled since sampling carries no more than twice its weight)."""

PROB_DIFF_MASK = 0.2
"""``prime``: mask a token whose probability moved more than this since sampling, in the advantage's
direction (prime-rl's default)."""

LOG_RATIO_TAU = 1e-3
"""``prime``: weight of the (log ratio)^2 term (prime-rl's default tau)."""


@dataclass(frozen=True)
class TokenTerms:
    """A variant's per-token loss ``[B, T]`` and the tokens it cut (``[B, T]`` bool, detached)."""

    per_token: torch.Tensor
    cut: torch.Tensor


def _masked_log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, bound: float) -> torch.Tensor:
    """a - b on the completion tokens, 0 elsewhere (padding may hold anything), clamped to +-bound."""
    return torch.where(mask, a - b, torch.zeros_like(a)).clamp(-bound, bound)


def clipped_terms(log_ratio: torch.Tensor, adv: torch.Tensor, *, eps_low: float, eps_high: float,
                  neg_cap: float) -> TokenTerms:
    """PPO's clipped objective with INTELLECT-2's cap ``neg_cap`` on negative advantages."""
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    unclipped = torch.where(adv < 0, torch.clamp(ratio, max=neg_cap), ratio)
    per_token = -torch.minimum(unclipped * adv, clipped * adv)
    with torch.no_grad():
        # No gradient where the chosen term is constant in rho: the clipped one outside [1-eps, 1+eps], or
        # the capped one above delta.
        cut = ((ratio > 1.0 + eps_high) & (adv > 0)) | ((ratio < 1.0 - eps_low) & (adv < 0)) \
            | ((ratio > neg_cap) & (adv < 0))
    return TokenTerms(per_token, cut)


def grpo_terms(logp: torch.Tensor, sampler: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
               eps_low: float, eps_high: float, neg_cap: float, bound: float) -> TokenTerms:
    """``grpo``: the trust region around the sampler."""
    return clipped_terms(_masked_log_ratio(logp, sampler, mask, bound), adv, eps_low=eps_low,
                         eps_high=eps_high, neg_cap=neg_cap)


def intellect2_terms(logp: torch.Tensor, sampler: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                     eps_low: float, eps_high: float, neg_cap: float, is_cap: float,
                     bound: float) -> TokenTerms:
    """``intellect2``: the trust region around the trainer's own log-probabilities before the update, times
    the truncated, detached staleness weight min(pi_old / pi_sampler, is_cap)."""
    old = logp.detach()
    inner = clipped_terms(_masked_log_ratio(logp, old, mask, bound), adv, eps_low=eps_low,
                          eps_high=eps_high, neg_cap=neg_cap)
    with torch.no_grad():
        stale = torch.exp(_masked_log_ratio(old, sampler, mask, bound))
        weight = torch.clamp(stale, max=is_cap)
    return TokenTerms(weight * inner.per_token, inner.cut | (stale > is_cap))


def prime_terms(logp: torch.Tensor, sampler: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                prob_diff: float, tau: float, bound: float) -> TokenTerms:
    """``prime``: -rho A unclipped on the tokens whose probability did not move more than ``prob_diff`` in
    the advantage's direction, plus ``tau`` (log rho)^2 on every token."""
    log_ratio = _masked_log_ratio(logp, sampler, mask, bound)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        dp = torch.exp(logp.detach()) - torch.exp(sampler)
        cut = ((adv > 0) & (dp > prob_diff)) | ((adv < 0) & (dp < -prob_diff))
    per_token = torch.where(cut, torch.zeros_like(ratio), -ratio * adv) + tau * log_ratio.square()
    return TokenTerms(per_token, cut)


def mis_terms(logp: torch.Tensor, sampler: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
              is_cap: float, bound: float) -> TokenTerms:
    """``mis``: -rho A on the tokens whose ratio rho lies in [1/is_cap, is_cap], nothing on the others."""
    ratio = torch.exp(_masked_log_ratio(logp, sampler, mask, bound))
    with torch.no_grad():
        cut = (ratio > is_cap) | (ratio < 1.0 / is_cap)
    return TokenTerms(torch.where(cut, torch.zeros_like(ratio), -ratio * adv), cut)
