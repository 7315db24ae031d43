"""The GRPO objective against values computed by hand (INTELLECT-2 two-sided clipping, constant budget)."""

from __future__ import annotations

import math

import pytest
import torch

from intellect_node.errors import ConfigError
from intellect_node.trainer.grpo import GRPOConfig, group_advantages, grpo_loss, token_entropy, token_logprobs

torch.set_num_threads(1)


def test_group_advantages_are_mean_centred_per_group() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert group_advantages(r, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    scaled = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, scale_by_std=True)
    std = math.sqrt(((0.75 ** 2) + 3 * 0.25 ** 2) / 3)  # unbiased
    assert scaled.tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), 4)


# (advantage, ratio, hand-computed loss term, hand-computed d(term)/d(logprob))
CASES = [
    (+1.0, 1.5, -1.2, 0.0),   # A>0, ratio above 1+eps: clipped term wins, no gradient
    (+1.0, 0.5, -0.5, -0.5),  # A>0, ratio below 1-eps: unclipped term wins, gradient -rho*A
    (-1.0, 0.5, 0.8, 0.0),    # A<0, ratio below 1-eps: clipped term (1-eps)*A wins, no gradient
    (-1.0, 2.0, 2.0, 2.0),    # A<0, 1+eps < ratio < delta: unclipped term, gradient -rho*A
    (-1.0, 6.0, 4.0, 0.0),    # A<0, ratio above delta=4: capped at 4 (plain PPO would give 6), no gradient
    (+2.0, 1.1, -2.2, -2.2),  # inside the trust region: -rho*A
]


def _tensors(
        cases: list[tuple[float, float, float, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    adv = torch.tensor([[c[0] for c in cases]])
    old = torch.full((1, len(cases)), -1.0)
    logp = (old + torch.log(torch.tensor([[c[1] for c in cases]]))).requires_grad_(True)
    return logp, old, adv


def test_loss_matches_hand_computed_terms_and_gradients() -> None:
    cfg = GRPOConfig(group_size=2, token_budget=10)
    logp, old, adv = _tensors(CASES)
    parts = grpo_loss(logp, old, adv, torch.ones_like(adv, dtype=torch.bool), cfg)
    expected = sum(c[2] for c in CASES) / 10
    assert parts.loss.item() == pytest.approx(expected, abs=1e-6)
    torch.autograd.backward(parts.loss)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([c[3] / 10 for c in CASES], abs=1e-6)
    assert parts.tokens == len(CASES)
    assert parts.clipped_frac == pytest.approx(3 / 6)
    assert parts.ratio_max == pytest.approx(6.0, rel=1e-5)


def test_delta_cap_bounds_the_negative_advantage_term() -> None:
    logp, old, adv = _tensors([(-1.0, 100.0, 0.0, 0.0)])
    mask = torch.ones_like(adv, dtype=torch.bool)
    capped = grpo_loss(logp, old, adv, mask, GRPOConfig(group_size=2, token_budget=1))
    loose = grpo_loss(logp, old, adv, mask, GRPOConfig(group_size=2, token_budget=1, neg_ratio_cap=1000.0))
    assert capped.loss.item() == pytest.approx(4.0, rel=1e-5)
    assert loose.loss.item() == pytest.approx(100.0, rel=1e-4)


def test_normaliser_is_the_constant_budget_not_the_token_count() -> None:
    cfg = GRPOConfig(group_size=2, token_budget=100)
    logp, old, adv = _tensors(CASES)
    mask = torch.tensor([[True, True, False, False, False, False]])
    parts = grpo_loss(logp, old, adv, mask, cfg)
    assert parts.loss.item() == pytest.approx((-1.2 - 0.5) / 100, abs=1e-7)
    assert parts.tokens == 2
    # Padding may hold garbage logprobs: masked positions never reach the loss.
    logp2 = logp.detach().clone()
    logp2[0, 2:] = 1e4
    assert grpo_loss(logp2, old, adv, mask, cfg).loss.item() == pytest.approx(parts.loss.item(), abs=1e-7)


def test_kl_and_entropy_terms_off_by_default_and_hand_computed_when_on() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    old = logp.clone()
    ref = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([0.0])
    mask = torch.ones_like(logp, dtype=torch.bool)
    assert grpo_loss(logp, old, adv, mask, GRPOConfig(group_size=2, token_budget=2)).loss.item() == 0.0
    cfg = GRPOConfig(group_size=2, token_budget=2, kl_coef=0.5, entropy_coef=0.1)
    ent = torch.tensor([[0.3, 0.7]])
    parts = grpo_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
    k3 = sum(math.exp(d) - d - 1 for d in (-0.5, 1.0))  # ref - logp
    assert parts.loss.item() == pytest.approx(0.5 * k3 / 2 - 0.1 * 1.0 / 2, abs=1e-6)
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, mask, cfg)


def test_logprob_and_entropy_helpers() -> None:
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)]]])  # probs 1/4, 1/4, 1/2
    assert float(token_logprobs(logits, torch.tensor([[2]]))) == pytest.approx(math.log(0.5))
    assert float(token_entropy(logits)) == pytest.approx(-(0.5 * math.log(0.25) + 0.5 * math.log(0.5)))


@pytest.mark.parametrize("field,value", [("group_size", 1), ("clip_eps_low", 1.0), ("neg_ratio_cap", 1.1),
                                         ("token_budget", 0), ("kl_coef", -1.0), ("max_grad_norm", 0.0)])
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        GRPOConfig(**{field: value})  # type: ignore[arg-type]  # a wrong value on purpose
    assert exc.value.field == field and field in str(exc.value)


def test_defaults_follow_intellect2() -> None:
    cfg = GRPOConfig()
    assert (cfg.group_size, cfg.clip_eps_low, cfg.clip_eps_high, cfg.neg_ratio_cap) == (16, 0.2, 0.2, 4.0)
    assert cfg.kl_coef == 0.0 and cfg.entropy_coef == 0.0
