"""The lr schedule (``trainer/stepsize.py``): warmup, the target-KL controller and its bounds."""

from __future__ import annotations

import math

import pytest

from intellect_node.trainer.stepsize import (
    MAX_SCALE,
    MIN_SCALE,
    in_bounds,
    measured,
    next_scale,
    step_lr,
    warmup,
)


def test_warmup_is_linear_to_the_full_lr() -> None:
    assert [warmup(n, 4) for n in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup(0, 0) == 1.0 and warmup(7, 1) == 1.0
    assert step_lr(1e-3, 1, 4, 2.0) == 1e-3 * 0.5 * 2.0


def test_without_a_target_the_scale_stays_one() -> None:
    assert next_scale(1.0, 0.5, None) == 1.0
    assert in_bounds(1.0, None) and not in_bounds(2.0, None)


def test_the_scale_moves_by_the_square_root_of_target_over_measured_at_most_twofold() -> None:
    assert next_scale(1.0, 0.04, 0.01) == pytest.approx(0.5)   # KL 4x the target: half the step
    assert next_scale(1.0, 0.0025, 0.01) == pytest.approx(2.0)  # KL a quarter: twice
    assert next_scale(1.0, 1.0, 0.01) == 0.5                    # 100x: still only halved
    assert next_scale(1.0, 0.0, 0.01) == 2.0                    # nothing moved: grow at the bound
    assert next_scale(1.0, 0.01 * 1.21, 0.01) == pytest.approx(1 / 1.1)


def test_the_scale_stays_within_its_bounds() -> None:
    s = 1.0
    for _ in range(20):
        s = next_scale(s, 10.0, 0.01)
    assert s == MIN_SCALE
    for _ in range(20):
        s = next_scale(s, 1e-9, 0.01)
    assert s == MAX_SCALE and in_bounds(s, 0.01) and not in_bounds(MAX_SCALE * 2, 0.01)


def test_nothing_measured_keeps_the_scale() -> None:
    assert next_scale(0.5, None, 0.01) == 0.5
    assert next_scale(0.5, math.nan, 0.01) == 0.5
    assert measured(0.3, [2, 2], 2) is None  # every sample of the base version: on-policy, no signal
    assert measured(0.3, [2, 1], 2) == 0.3
