"""Audits within a calibrated tolerance (``roles/auditor/tolerance.py``), on the real embedded model.

The differing condition is one this process can make: the "trainer" here trains with padded rows and the
auditor replays with each group's prompt shared (``trainer/step.py``: the same sums up to float
rounding), so their weights differ in the last bits as a replay on another CPU's kernels does.

- comparing: the same weights are within any tolerance; a learning rate 10% off is 0.1/1.1 of the update
  away in every tensor; weights naming other tensors are never within;
- calibration: honest replays under the differing condition give a small worst difference, the tolerance
  is ``worst * factor + floor``, and it holds for honest steps it did not see;
- a window replay with the calibrated tolerance passes every honest step (bitwise it fails them), fails a
  step trained with another learning rate than its record states, and reports ``unavailable`` when the
  published weights cannot be had.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from intellect_node.config.loader import build_config
from intellect_node.errors import ConfigError
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.steps import StepBatch, StepRecord
from intellect_node.roles.auditor.replay import StepAudit, WindowReplay, weights_hash
from intellect_node.roles.auditor.tolerance import AuditMargins, calibrate, compare, tensor_diffs, worst
from intellect_node.roles.common.grpo import grpo_config_of, settings_of
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.step import Sample, make_optimizer, train_step

LR = 2e-4
GCFG = GRPOConfig(group_size=8, max_grad_norm=0.1)
SETTINGS = settings_of(GCFG, lr=LR, temperature=1.0, micro_tokens=None, compute_dtype=None)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # as the trainer and the auditor run


def _groups(n: int, seed: int) -> list[list[Sample]]:
    """``n`` groups of 8 completions of a random prompt (token IDs of the embedded vocabulary), rewards
    mixed so that every group has a signal."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = tuple(rng.randrange(3, 60) for _ in range(rng.randrange(6, 12)))
        group = []
        for i in range(8):
            comp = tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 6)))
            old = tuple(-2.0 - 0.1 * rng.random() for _ in comp)
            group.append(Sample(prompt, comp, old, float(i % 3 == 0)))
        out.append(group)
    return out


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainer_chain(steps: list[list[list[Sample]]], *, lr: float = LR
                   ) -> tuple[list[dict[str, torch.Tensor]], list[StepRecord]]:
    """The "trainer": every step with padded rows (``pack=False``) at ``lr``, its records stating
    :data:`SETTINGS` (the run's learning rate). Returns the weights after each step (index 0: the start)
    and the records."""
    model = load_trainable(None)
    opt = make_optimizer(model, lr)
    states, recs = [_state(model)], []
    for i, groups in enumerate(steps):
        base_hash = weights_hash(model)
        train_step(model, opt, [s for g in groups for s in g], GCFG, pack=False)
        states.append(_state(model))
        batch = StepBatch(cid=cid_of(f"batch {i}".encode()), worker="w", groups=len(groups),
                          trained=list(range(len(groups))))
        recs.append(StepRecord(run_id="tol", seq=i + 1, step=i + 1, base_version=i, base_hash=base_hash,
                               version=i + 1, checkpoint_hash=weights_hash(model), batches=[batch],
                               settings=SETTINGS))
    return states, recs


STEPS = [_groups(3, seed) for seed in range(4)]


@pytest.fixture(scope="module")
def honest() -> tuple[list[dict[str, torch.Tensor]], list[StepRecord]]:
    torch.set_num_threads(1)
    return _trainer_chain(STEPS)


Weights = dict[str, torch.Tensor]


def _auditor_replays(states: list[Weights], steps: list[list[list[Sample]]]
                     ) -> list[tuple[Weights, Weights, Weights]]:
    """(base, replayed, published) of each step, replayed as the auditor does (prompts shared, its own
    optimizer, each step from the published base)."""
    model = load_trainable(None)
    opt = make_optimizer(model, LR)
    out = []
    for i, groups in enumerate(steps):
        model.load_state_dict(states[i])
        train_step(model, opt, [s for g in groups for s in g], grpo_config_of(SETTINGS))
        out.append((states[i], _state(model), states[i + 1]))
    return out


def test_compare_same_scaled_and_mismatched_weights(honest: Any) -> None:
    states, _ = honest
    base, new = states[0], states[1]
    same = compare(new, PolicyWeights.from_state_dict(new), 0.0, base=base)
    assert same.within and same.worst is not None and same.worst.relative == 0.0

    # A step 10% larger than the replay's (a learning rate 10% off, in AdamW's first step): 0.1/1.1 away.
    larger = {k: base[k] + 1.1 * (new[k] - base[k]) for k in new}
    c = compare(larger, new, 1e-3, base=base)
    assert not c.within and c.worst is not None
    assert c.worst.relative == pytest.approx(0.1 / 1.1, rel=1e-2)  # fp32 rounding of the scaled weights
    assert c.worst.name in c.reason and "tolerance" in c.reason
    assert compare(larger, new, 0.1, base=base).within

    # Another tensor name, or a tensor the replay did not move that the published step moved.
    renamed = {("x." + k if i == 0 else k): v for i, (k, v) in enumerate(new.items())}
    assert not compare(new, renamed, 0.5, base=base).within
    name = next(iter(new))
    unmoved = dict(new, **{name: base[name]})
    w = worst(tensor_diffs(unmoved, new, base))
    assert w is not None and w.name == name and math.isinf(w.relative)


def test_calibration_covers_honest_steps_it_did_not_see(honest: Any) -> None:
    states, _ = honest
    seen = _auditor_replays(states, STEPS)
    cal = calibrate(seen[:2], condition="padded -> packed", margins=AuditMargins(factor=4.0, floor=1e-5))
    assert cal.steps == 2
    assert 0.0 < cal.observed < 1e-2, cal  # rounding, not a different step
    assert cal.tolerance == pytest.approx(cal.observed * 4.0 + 1e-5)
    assert cal.to_json()["tolerance"] == cal.tolerance
    for base, replayed, published in seen[2:]:
        assert compare(replayed, published, cal.tolerance, base=base).within
    # A bitwise condition (the trainer's own, replayed again) observes nothing: the floor alone.
    model = load_trainable(None)
    opt = make_optimizer(model, LR)
    train_step(model, opt, [s for g in STEPS[0] for s in g], GCFG, pack=False)
    assert calibrate([(states[0], _state(model), states[1])], condition="same").observed == 0.0
    with pytest.raises(ValueError, match="no honest steps"):
        calibrate([], condition="none")


def _replay(states: list[dict[str, torch.Tensor]], recs: list[StepRecord], tolerance: float, *,
            published: bool = True) -> list[StepAudit]:
    weights = [PolicyWeights.from_state_dict(s) for s in states]
    by_hash = {w.content_hash: w for w in weights}
    groups = {b.cid: STEPS[r.seq - 1] for r in recs for b in r.batches}
    model = load_trainable(None)
    replay = WindowReplay(model, SETTINGS, tolerance=tolerance,
                          published=(lambda rec, _: by_hash.get(rec.checkpoint_hash)) if published else None)
    return [replay.audit(rec, lambda b: groups[b.cid]) for rec in recs]


def test_window_replay_within_the_calibrated_tolerance(honest: Any) -> None:
    states, recs = honest
    cal = calibrate(_auditor_replays(states, STEPS[:2]), condition="padded -> packed")

    # Bitwise, the auditor's condition fails an honest trainer at its first step.
    strict = _replay(states, recs, 0.0)
    assert [a.outcome for a in strict] == ["fail"] + ["unavailable"] * (len(recs) - 1), strict

    # Within the calibrated tolerance, every honest step passes, each naming the published hash.
    within = _replay(states, recs, cal.tolerance)
    assert [a.outcome for a in within] == ["pass"] * len(recs), within
    assert [a.expected for a in within] == [r.checkpoint_hash for r in recs]
    assert all(a.reason.startswith("within tolerance") for a in within)

    # The published weights not to be had: unavailable, never a pass.
    missing = _replay(states, recs, cal.tolerance, published=False)
    assert missing[0].outcome == "unavailable" and "could not be had" in missing[0].reason


def test_a_learning_rate_other_than_stated_fails_within_tolerance(honest: Any) -> None:
    states, _ = honest
    cal = calibrate(_auditor_replays(states, STEPS[:2]), condition="padded -> packed")
    lied_states, lied = _trainer_chain(STEPS[:2], lr=LR * 1.1)  # records state LR
    audits = _replay(lied_states, lied, cal.tolerance)
    assert [a.outcome for a in audits] == ["fail", "unavailable"], audits
    assert "of its update" in audits[0].reason and audits[0].expected != audits[0].published


def test_run_audit_tolerance_is_checked() -> None:
    assert build_config({}).run.audit_tolerance == 0.0
    assert build_config({"run": {"audit_tolerance": 1e-3}}).run.audit_tolerance == 1e-3
    with pytest.raises(ConfigError) as info:
        build_config({"run": {"audit_tolerance": -1}})
    assert info.value.field == "run.audit_tolerance"
