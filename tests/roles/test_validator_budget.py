"""The validator's scoring budgets (``roles/validator/budget.py``), driven step by step with explicit
times: a batch's allowance, a peer's bucket across batches, and the bound on peers kept."""

from __future__ import annotations

import pytest

from intellect_node.config import NodeConfig
from intellect_node.envs.sandbox import ScoringFailed
from intellect_node.roles.validator import budget as budget_mod
from intellect_node.roles.validator.budget import PEER_BURST_MIN, ScoringBudgets, ScoringRules

RULES = ScoringRules(per_rollout_s=0.5, timeouts=1, timeout_s=5.0, peer_s_per_min=30.0)


def test_a_batch_may_use_its_rollouts_share_plus_room_for_its_timeouts() -> None:
    budgets = ScoringBudgets(RULES)
    meter = budgets.meter("w", 16, now=0.0)
    assert (meter.seconds, meter.timeouts) == (16 * 0.5 + 5.0, 1)


def test_a_peer_that_used_its_bucket_gets_nothing_scored_until_it_refills() -> None:
    budgets = ScoringBudgets(RULES)
    burst = 30.0 * PEER_BURST_MIN  # 300 s
    big = budgets.meter("w", 1024, now=0.0)
    assert big.seconds == burst  # less than the batch's own allowance (517 s): the bucket's
    big.charge(burst)
    budgets.charge("w", big, now=0.0)
    assert budgets.meter("w", 4, now=0.0).seconds == 0.0
    assert budgets.meter("w", 4, now=10.0).seconds == pytest.approx(5.0)  # 30 s a minute come back
    assert budgets.meter("other", 4, now=0.0).seconds == 7.0  # another peer is not charged for it


def test_a_batch_cut_short_counts_as_refused() -> None:
    budgets = ScoringBudgets(RULES)
    meter = budgets.meter("w", 2, now=0.0)
    meter.charge(5.0, timed_out=True)
    with pytest.raises(ScoringFailed, match="budget"):
        meter.charge(5.0, timed_out=True)
    budgets.charge("w", meter, now=0.0)
    assert budgets.status()["refused"] == 1


def test_peers_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget_mod, "MAX_PEERS", 3)
    budgets = ScoringBudgets(RULES)
    for i in range(10):
        budgets.charge(f"w{i}", budgets.meter(f"w{i}", 1, now=0.0), now=0.0)
    assert budgets.status()["peers"] == 3


def test_rules_come_from_the_configuration() -> None:
    validator = {"scoring_s_per_rollout": 0.25, "scoring_timeouts_per_batch": 2,
                 "peer_scoring_s_per_min": 12.0}
    cfg = NodeConfig.model_validate({"rl": {"reward_timeout_s": 7.0}, "validator": validator})
    assert ScoringRules.from_config(cfg) == ScoringRules(0.25, 2, 7.0, 12.0)
