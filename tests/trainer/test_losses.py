"""Each ``rl.loss`` variant's per-token loss and gradient against values computed by hand
(``trainer/losses.py``), through ``grpo.grpo_loss`` as the step calls it; and the per-step diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from intellect_node.errors import ConfigError
from intellect_node.trainer.grpo import GRPOConfig, LossParts, grpo_loss

torch.set_num_threads(1)

L = math.log


Case = tuple[float, float, float, float, float]


def _run(cfg: GRPOConfig, cases: list[Case]) -> tuple[LossParts, list[float]]:
    """``cases``: (advantage, p_theta, p_sampler, hand loss term, hand d(term)/d(log p_theta)). The loss and
    each token's gradient, with a budget of 1 so the loss is the plain sum."""
    adv = torch.tensor([[c[0] for c in cases]])
    logp = torch.tensor([[L(c[1]) for c in cases]], requires_grad=True)
    sampler = torch.tensor([[L(c[2]) for c in cases]])
    parts = grpo_loss(logp, sampler, adv, torch.ones_like(adv, dtype=torch.bool), cfg)
    torch.autograd.backward(parts.loss)
    assert logp.grad is not None
    return parts, logp.grad[0].tolist()


def _check(cfg: GRPOConfig, cases: list[Case], cut: int) -> None:
    parts, grad = _run(cfg, cases)
    assert parts.loss.item() == pytest.approx(sum(c[3] for c in cases), abs=1e-5)
    assert grad == pytest.approx([c[4] for c in cases], abs=1e-5)
    assert parts.clipped_frac == pytest.approx(cut / len(cases))


def test_intellect2_weights_each_token_by_its_truncated_staleness_and_clips_nothing() -> None:
    # The trust region is centred on pi_old = p_theta (one step per batch): rho = 1, gradient -w A with
    # w = min(p_theta / p_sampler, cap), detached.
    cfg = GRPOConfig(group_size=2, token_budget=1, loss="intellect2", is_cap=1.5)
    cases = [
        (+1.0, 0.5, 0.25, -1.5, -1.5),   # w = 2 truncated at 1.5
        (-1.0, 0.2, 0.4, 0.5, 0.5),      # w = 0.5
        (+2.0, 0.3, 0.3, -2.0, -2.0),    # on-policy: w = 1, plain policy gradient
        (-1.0, 0.9, 0.1, 1.5, 1.5),      # w = 9 truncated; plain GRPO would clip this token (rho 9 > delta)
    ]
    _check(cfg, cases, cut=2)


def test_prime_masks_by_probability_change_in_the_advantage_direction_and_adds_the_log_ratio_term() -> None:
    tau = 0.1
    cfg = GRPOConfig(group_size=2, token_budget=1, loss="prime", log_ratio_tau=tau)
    cases = [
        (+1.0, 0.5, 0.2, tau * L(2.5) ** 2, 2 * tau * L(2.5)),            # dp +0.3 with A > 0: masked
        (+1.0, 0.3, 0.2, -1.5 + tau * L(1.5) ** 2, -1.5 + 2 * tau * L(1.5)),  # dp +0.1: -rho A
        (-1.0, 0.1, 0.4, tau * L(0.25) ** 2, 2 * tau * L(0.25)),           # dp -0.3 with A < 0: masked
        (-1.0, 0.5, 0.2, 2.5 + tau * L(2.5) ** 2, 2.5 + 2 * tau * L(2.5)),  # dp +0.3 against A: unclipped
    ]
    _check(cfg, cases, cut=2)


def test_mis_masks_tokens_outside_the_ratio_band_and_weights_the_rest_by_the_ratio() -> None:
    cfg = GRPOConfig(group_size=2, token_budget=1, loss="mis", is_cap=2.0)
    cases = [
        (+1.0, 0.3, 0.2, -1.5, -1.5),   # rho 1.5: -rho A (no clip at 1.2)
        (+1.0, 0.6, 0.2, 0.0, 0.0),     # rho 3 > 2: masked
        (-1.0, 0.1, 0.25, 0.0, 0.0),    # rho 0.4 < 1/2: masked
        (-1.0, 0.4, 0.5, 0.8, 0.8),     # rho 0.8: -rho A
    ]
    _check(cfg, cases, cut=2)


def test_grpo_default_is_the_clipped_objective_around_the_sampler() -> None:
    cfg = GRPOConfig(group_size=2, token_budget=1)
    cases = [(+1.0, 0.3, 0.2, -1.2, 0.0), (+1.0, 0.22, 0.2, -1.1, -1.1)]
    _check(cfg, cases, cut=1)


def test_diagnostics_are_the_sampler_kl_ratio_and_entropy_estimate_per_token() -> None:
    cases = [(+1.0, 0.3, 0.2, 0.0, 0.0), (-1.0, 0.1, 0.4, 0.0, 0.0)]
    parts, _ = _run(GRPOConfig(group_size=2, token_budget=1, loss="mis"), cases)
    rhos = [1.5, 0.25]
    k3 = [r - 1 - L(r) for r in rhos]  # KL(sampler || current) estimated on the sampled tokens
    assert parts.kl_sampler == pytest.approx(sum(k3) / 2, rel=1e-5)
    assert parts.ratio_mean == pytest.approx(sum(rhos) / 2, rel=1e-5)
    assert parts.ratio_max == pytest.approx(1.5, rel=1e-5)
    assert parts.neg_logp == pytest.approx(-(L(0.3) + L(0.1)) / 2, rel=1e-5)


def test_a_forged_sampler_logprob_stays_finite_in_every_variant() -> None:
    for loss in ("grpo", "intellect2", "prime", "mis"):
        adv = torch.tensor([[1.0, -1.0]])
        logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        sampler = torch.tensor([[-89.0, -89.0]])
        parts = grpo_loss(logp, sampler, adv, torch.ones_like(adv, dtype=torch.bool),
                          GRPOConfig(group_size=2, token_budget=1, loss=loss))
        torch.autograd.backward(parts.loss)
        assert logp.grad is not None and torch.isfinite(logp.grad).all(), loss
        assert math.isfinite(parts.loss.item()), loss


@pytest.mark.parametrize("field, value", [("loss", "ppo"), ("is_cap", 1.0), ("prob_diff_mask", 0.0),
                                          ("log_ratio_tau", -1.0)])
def test_bad_variant_settings_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        GRPOConfig(**{field: value})  # type: ignore[arg-type]  # a wrong value on purpose
