"""The learning rate of each step: linear warmup, and an optional controller toward a target KL per token.

The lr of the step that is the trainer's ``n``-th (0-based count of steps trained before it) is

    lr_n = rl.lr x min(1, (n + 1) / rl.lr_warmup_steps) x scale_n

``scale`` is 1 unless ``rl.target_kl`` is set. Then each trained step measures the mean per-token
KL(sampler || current) of the batch it trained (``grpo.LossParts.kl_sampler``: how far the weights the
step started from had moved from the policies that sampled its batch), and the next step's scale moves
toward the target: KL grows about with the square of the step, so the scale is multiplied by
sqrt(target / KL), at most x2 or /2 a step, and kept within [:data:`MIN_SCALE`, :data:`MAX_SCALE`].

A batch sampled by the very weights it trains on tells nothing about the step size (its KL is only
the sampler's and trainer's numerical difference): a step whose samples are all of its base version
keeps the scale (``kl`` None). Everything here is plain Python float arithmetic on values the step
record carries or the replay recomputes, so an auditor gets the same lr bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MIN_SCALE = 1.0 / 16.0
"""The controller never takes the lr below rl.lr / 16 ..."""
MAX_SCALE = 4.0
"""... nor above 4 x rl.lr."""
MAX_MOVE = 2.0
"""The most one step multiplies or divides the scale by: one noisy KL cannot swing the lr."""


def warmup(trained_before: int, warmup_steps: int) -> float:
    """The warmup's factor for the step after ``trained_before`` trained steps: linear from
    1 / warmup_steps to 1 (1 throughout with no warmup)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (trained_before + 1) / warmup_steps)


def step_lr(base: float, trained_before: int, warmup_steps: int, scale: float) -> float:
    """The lr of the step after ``trained_before`` trained steps."""
    return base * warmup(trained_before, warmup_steps) * scale


def next_scale(scale: float, kl: float | None, target: float | None) -> float:
    """The scale after a step that measured ``kl`` (None: no batch older than the step's base, nothing
    measured) with ``target`` (None: no controller, always 1)."""
    if target is None:
        return 1.0
    if kl is None or not math.isfinite(kl):
        return scale
    move = MAX_MOVE if kl <= 0.0 else min(MAX_MOVE, max(1.0 / MAX_MOVE, math.sqrt(target / kl)))
    return min(MAX_SCALE, max(MIN_SCALE, scale * move))


def in_bounds(scale: float, target: float | None) -> bool:
    """Whether a recorded scale is one the controller can reach (exactly 1 without one)."""
    if target is None:
        return scale == 1.0
    return MIN_SCALE <= scale <= MAX_SCALE


def measured(kl: float, versions: Iterable[int], base_version: int) -> float | None:
    """What the controller takes from a step that measured ``kl`` on samples of policy ``versions``,
    updating ``base_version``: the KL when a sample is older than the base, else None (nothing learnt)."""
    return kl if any(v < base_version for v in versions) else None
