"""The step-too-large warning (``roles/trainer/stepcheck.py``): in band says nothing; out of band names
what was out and the settings to change; logged once per streak."""

from __future__ import annotations

import logging

import pytest

from intellect_node.config import RLConfig
from intellect_node.roles.trainer.stepcheck import StepCheck, too_large
from intellect_node.trainer.step import StepStats


def _stats(kl: float, cut: float) -> StepStats:
    return StepStats(loss=0.0, grad_norm=0.1, tokens=100, samples=8, clipped_frac=cut, ratio_mean=1.0,
                     ratio_max=1.5, reward_mean=0.5, kl_sampler=kl, lr=5e-5)


def test_a_step_in_band_says_nothing() -> None:
    assert too_large(_stats(0.005, 0.046), RLConfig()) == ""  # the healthy lr (1e-5 on SmolLM2)


def test_a_large_step_names_what_was_out_and_the_settings_to_change() -> None:
    w = too_large(_stats(0.12, 0.36), RLConfig(lr=5e-5))  # the lr 5e-5
    assert "KL to the sampler 0.120 nats/token" in w and "36% of tokens" in w
    assert "rl.lr (5e-05" in w and "rl.target_kl" in w and "rl.lr_warmup_steps" in w
    w = too_large(_stats(0.01, 0.5), RLConfig(target_kl=0.01, lr_warmup_steps=10))
    assert "50% of tokens" in w and "KL" not in w.split(";")[0].removeprefix("the step is too large")
    assert "rl.target_kl" not in w and "rl.lr_warmup_steps" not in w


def test_the_warning_is_logged_once_a_streak(caplog: pytest.LogCaptureFixture) -> None:
    check = StepCheck(RLConfig())
    with caplog.at_level(logging.WARNING, logger="intellect_node.roles.trainer.stepcheck"):
        seq = [check.checked(_stats(kl, 0.0)) for kl in (0.2, 0.3, 0.001, 0.2)]
    assert [bool(w) for w in seq] == [True, True, False, True]
    assert len(caplog.records) == 2
