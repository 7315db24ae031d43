"""A published step with NaN or inf in it is never within an audit tolerance (``roles/auditor/
tolerance.py``): NaN compares false both ways, so it could hide behind another tensor's
difference as the worst one and pass."""

from __future__ import annotations

import math

import pytest
import torch

from intellect_node.roles.auditor.tolerance import compare, tensor_diffs


def _states(bad: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base = {"a": torch.zeros(4), "b": torch.zeros(4)}
    replayed = {"a": torch.ones(4), "b": torch.ones(4)}
    published = {"a": torch.full((4,), 1.001), "b": torch.tensor([1.0, bad, 1.0, 1.0])}
    return base, replayed, published


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_published_weights_fail_any_tolerance(bad: float) -> None:
    base, replayed, published = _states(bad)
    c = compare(replayed, published, 0.5, base=base)
    assert not c.within
    assert c.worst is not None and c.worst.name == "b" and c.worst.relative == math.inf
    assert "not finite" in c.reason


def test_non_finite_moments_compared_from_zero_fail() -> None:
    """Optimizer moments are compared with zero as the base (``windows.py``)."""
    own = {"exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    pub = {"exp_avg": torch.ones(3), "exp_avg_sq": torch.tensor([1.0, math.nan, 1.0])}
    zero = {k: torch.zeros_like(v) for k, v in own.items()}
    assert not compare(own, pub, 0.9, base=zero).within


def test_a_non_finite_replay_is_not_within_either() -> None:
    base, replayed, published = _states(1.0)
    replayed["a"] = torch.tensor([math.nan, 1.0, 1.0, 1.0])
    diffs = {d.name: d for d in tensor_diffs(replayed, published, base)}
    assert diffs["a"].relative == math.inf
    assert not compare(replayed, published, 0.5, base=base).within
