"""The GRPO settings of a run and of a trainer's step record, one way both directions: what the trainer
writes in each record (:func:`settings_of`), the config a run's ``[rl]`` makes (:func:`run_grpo_config`),
and the config a record's settings name (:func:`grpo_config_of`), which an auditor replays with. Shared by
the trainer and the auditor, so neither reads the other's internals."""

from __future__ import annotations

import torch

from intellect_node.config.schema import RLConfig
from intellect_node.protocol.steps import StepSettings
from intellect_node.trainer.grpo import GRPOConfig


def settings_of(gcfg: GRPOConfig, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                weight_decay: float = 0.0, temperature: float, micro_tokens: int | None,
                compute_dtype: torch.dtype | None, warmup_steps: int = 0, target_kl: float | None = None,
                lr_scale: float = 1.0) -> StepSettings:
    """The record's settings: every number ``train_step`` and ``make_optimizer`` read (their defaults for
    the optimizer's betas and weight decay, which the trainer does not change), and the schedule's."""
    return StepSettings(lr=lr, loss=gcfg.loss, is_cap=gcfg.is_cap, prob_diff_mask=gcfg.prob_diff_mask,
                        log_ratio_tau=gcfg.log_ratio_tau, warmup_steps=warmup_steps, target_kl=target_kl,
                        lr_scale=lr_scale, betas=betas, weight_decay=weight_decay, group_size=gcfg.group_size,
                        clip_eps_low=gcfg.clip_eps_low, clip_eps_high=gcfg.clip_eps_high,
                        neg_ratio_cap=gcfg.neg_ratio_cap, max_grad_norm=gcfg.max_grad_norm,
                        token_budget=gcfg.token_budget, kl_coef=gcfg.kl_coef, entropy_coef=gcfg.entropy_coef,
                        scale_by_std=gcfg.scale_by_std, temperature=temperature, micro_tokens=micro_tokens,
                        compute_dtype=None if compute_dtype is None
                        else str(compute_dtype).removeprefix("torch."))


def run_grpo_config(rl: RLConfig) -> GRPOConfig:
    """The GRPO config a run's ``[rl]`` section makes (the trainer's, and what an auditor expects)."""
    return GRPOConfig(group_size=rl.group_size, max_grad_norm=rl.max_grad_norm, kl_coef=rl.kl_coef,
                      token_budget=rl.groups_per_step * rl.group_size * rl.max_new_tokens, loss=rl.loss,
                      is_cap=rl.is_cap, prob_diff_mask=rl.prob_diff_mask, log_ratio_tau=rl.log_ratio_tau)


def grpo_config_of(s: StepSettings) -> GRPOConfig:
    """The GRPO config a record's settings name (the inverse of :func:`settings_of`)."""
    return GRPOConfig(group_size=s.group_size, clip_eps_low=s.clip_eps_low, clip_eps_high=s.clip_eps_high,
                      neg_ratio_cap=s.neg_ratio_cap, max_grad_norm=s.max_grad_norm,
                      token_budget=s.token_budget,
                      kl_coef=s.kl_coef, entropy_coef=s.entropy_coef, scale_by_std=s.scale_by_std,
                      loss=s.loss, is_cap=s.is_cap, prob_diff_mask=s.prob_diff_mask,
                      log_ratio_tau=s.log_ratio_tau)
