"""A step too large for its trust region, said so: the status board's ``step_warning``, one log line a streak.

Issue 39 measured what a too large step looks like on SmolLM2-135M one version stale: at lr 5e-5, 36% of
the tokens outside the clip and a KL of 0.11-0.15 nats per token to the sampler; at 1e-5, 4.6% and 0.005.
:func:`too_large` flags a step whose KL(sampler || current) per token is above :data:`KL_BAND` or whose
objective cut more than :data:`CUT_BAND` of the tokens, naming the settings that change it.
"""

from __future__ import annotations

import logging

from intellect_node.config import RLConfig
from intellect_node.trainer.step import StepStats

log = logging.getLogger(__name__)

KL_BAND = 0.05
"""Nats per token of KL(sampler || current) above which a step is too large: between the 0.005 of the
issue's healthy lr and its 0.11 of the one that stopped learning."""
CUT_BAND = 0.2
"""Fraction of tokens clipped, masked or truncated above which a step is too large (the issue's bad lr
cut 36%, the healthy one 4.6%)."""


def too_large(stats: StepStats, rl: RLConfig) -> str:
    """Why the step ``stats`` describes is too large, and what to change; "" when it is in band."""
    why = []
    if stats.kl_sampler > KL_BAND:
        why.append(f"KL to the sampler {stats.kl_sampler:.3f} nats/token (band {KL_BAND})")
    if stats.clipped_frac > CUT_BAND:
        why.append(f"{stats.clipped_frac:.0%} of tokens clipped or masked (band {CUT_BAND:.0%})")
    if not why:
        return ""
    fixes = f"lower rl.lr ({rl.lr:g}, step lr {stats.lr:g})"
    if rl.target_kl is None:
        fixes += ", set rl.target_kl (e.g. 0.01)"
    if rl.lr_warmup_steps == 0:
        fixes += ", warm up (rl.lr_warmup_steps)"
    return f"the step is too large: {' and '.join(why)}; {fixes}, or lower run.async_level"


class StepCheck:
    """Logs the first too-large step of each streak (the board carries the warning on every one)."""

    def __init__(self, rl: RLConfig) -> None:
        self._rl = rl
        self._logged = False

    def checked(self, stats: StepStats) -> str:
        warning = too_large(stats, self._rl)
        if warning and not self._logged:
            log.warning("%s", warning)
        self._logged = bool(warning)
        return warning
