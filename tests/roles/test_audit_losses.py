"""The auditor's replay of every ``rl.loss`` variant and of the lr schedule, in process on a tiny model.

A "trainer" here takes steps as the trainer role does (the settings of ``records.settings_of``, the lr of
``trainer/stepsize.py``, the scale moved by the KL each step measured) and signs nothing: the records
go straight to :class:`WindowReplay`, with the run's settings as an auditor builds them.

- each variant: an honest window replays bit for bit; a step nudged after training fails; a record
  that names one variant but was trained with another fails;
- warmup and the target-KL controller: the lr of each record replays; a record whose lr does not
  follow the warmup fails, and one whose scale is not what the previous step's KL makes fails;
- ``rl.micro_batch_tokens`` is the trainer's own: a trainer with another value than the auditor's passes
  (the replay uses the record's), and the replay at the auditor's value would not have made those bits.
"""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.steps import StepBatch, StepRecord, StepSettings, check_record
from intellect_node.roles.auditor.replay import StepAudit, WindowReplay, weights_hash
from intellect_node.roles.common.grpo import grpo_config_of, settings_of
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, make_optimizer, train_step
from intellect_node.trainer.stepsize import measured, next_scale, step_lr
from tests.support.grpo import scored_samples, tiny_llama

torch.set_num_threads(1)  # as the trainer and the auditor run: bitwise replays need it

GROUP = 4
RUN = "losses"
LR = 1e-2


def run_settings(loss: str = "grpo", *, micro_tokens: int | None = None, warmup_steps: int = 0,
                 target_kl: float | None = None, lr_scale: float = 1.0, lr: float = LR) -> StepSettings:
    cfg = GRPOConfig(group_size=GROUP, token_budget=64, max_grad_norm=1.0, loss=loss)
    return settings_of(cfg, lr=lr, temperature=1.0, micro_tokens=micro_tokens, compute_dtype=None,
                       warmup_steps=warmup_steps, target_kl=target_kl, lr_scale=lr_scale)


@functools.cache
def _groups(seed: int) -> tuple[tuple[Sample, ...], ...]:
    """Two groups with unequal rewards, sampled by another model than the trained one (so every ratio
    to the sampler differs from 1, as on a stale batch), of policy version 0."""
    samples = scored_samples(tiny_llama(seed=100), [[1, 3, 5], [1, 4]], GROUP, seed=seed)
    groups = tuple(tuple(samples[i:i + GROUP]) for i in range(0, len(samples), GROUP))
    assert all(len({s.reward for s in g}) > 1 for g in groups)
    return groups


class Trainer:
    """Steps and records as the trainer role makes them (``roles/trainer/role.py``: ``_settings``,
    ``_step``)."""

    def __init__(self, run: StepSettings) -> None:
        self.run = run
        self.model = tiny_llama(seed=5)
        self.opt = make_optimizer(self.model, run.lr)
        self.records: list[StepRecord] = []
        self.batches: dict[str, list[list[Sample]]] = {}
        self.scale = 1.0

    def step(self, *, nudge: bool = False, trained_as: str | None = None, lr_scale: float | None = None,
             lr: float | None = None, micro_tokens: int | None = None) -> None:
        """One step; the keywords make it dishonest: weights moved after the step, another loss than the
        record names, another scale or lr than the schedule's (stated in the record)."""
        n = len(self.records)
        groups = [list(g) for g in _groups(n)]
        samples = [s for g in groups for s in g]
        scale = self.scale if lr_scale is None else lr_scale
        settings = msgspec.structs.replace(
            self.run, lr=step_lr(self.run.lr, n, self.run.warmup_steps, scale) if lr is None else lr,
            lr_scale=scale, micro_tokens=self.run.micro_tokens if micro_tokens is None else micro_tokens)
        trained = settings if trained_as is None else msgspec.structs.replace(settings, loss=trained_as)
        base = weights_hash(self.model)
        stats = train_step(self.model, self.opt, samples, grpo_config_of(trained), temperature=1.0,
                           micro_tokens=trained.micro_tokens, lr=trained.lr)
        self.scale = next_scale(scale, measured(stats.kl_sampler, (s.policy_version for s in samples), n),
                                self.run.target_kl)
        if nudge:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1e-4)
        batch = StepBatch(cid=cid_of(f"batch-{n}".encode()), worker="12D3KooWworker", groups=len(groups),
                          trained=list(range(len(groups))))
        self.records.append(check_record(StepRecord(
            run_id=RUN, seq=n + 1, step=n + 1, base_version=n, base_hash=base, version=n + 1,
            checkpoint_hash=weights_hash(self.model), batches=[batch], settings=settings)))
        self.batches[batch.cid] = groups

    def audit(self, expected: StepSettings | None = None) -> list[StepAudit]:
        """The window from version 0, replayed on another copy of the start model."""
        replay = WindowReplay(tiny_llama(seed=5), expected or self.run)
        return [replay.audit(rec, lambda b: self.batches.get(b.cid)) for rec in self.records]


LOSSES = ("grpo", "intellect2", "prime", "mis")


@pytest.mark.parametrize("loss", LOSSES)
def test_an_honest_window_of_each_loss_replays_bit_for_bit(loss: str) -> None:
    t = Trainer(run_settings(loss))
    for _ in range(3):
        t.step()
    results = t.audit()
    assert [r.outcome for r in results] == ["pass"] * 3, results
    assert [r.expected for r in results] == [r.checkpoint_hash for r in t.records]


@pytest.mark.parametrize("loss", LOSSES)
def test_a_nudged_step_of_each_loss_fails(loss: str) -> None:
    t = Trainer(run_settings(loss))
    t.step()
    t.step(nudge=True)
    assert [r.outcome for r in t.audit()] == ["pass", "fail"]


@pytest.mark.parametrize("loss, other", [(loss, LOSSES[(i + 1) % 4]) for i, loss in enumerate(LOSSES)])
def test_a_step_trained_with_another_loss_than_its_record_names_fails(loss: str, other: str) -> None:
    t = Trainer(run_settings(loss))
    t.step()
    t.step(trained_as=other)
    results = t.audit()
    assert [r.outcome for r in results] == ["pass", "fail"], results
    assert "replayed weights differ" in results[1].reason


def test_a_record_of_another_loss_than_the_run_fails_on_its_settings() -> None:
    t = Trainer(run_settings("mis"))
    t.step()
    results = t.audit(run_settings("prime"))
    assert results[0].outcome == "fail" and "are not the run's" in results[0].reason


def test_warmup_and_the_target_kl_step_replay() -> None:
    run = run_settings(warmup_steps=3, target_kl=1e-3)
    t = Trainer(run)
    for _ in range(4):
        t.step()
    lrs = [r.settings.lr for r in t.records]
    scales = [r.settings.lr_scale for r in t.records]
    # step 1's batch is of its base version: nothing measured, the scale stays; the later ones are stale
    assert scales[0] == scales[1] == 1.0 and scales[2] != 1.0 and len(set(scales[1:])) > 1, scales
    assert lrs[:2] == pytest.approx([LR / 3, LR * 2 / 3]), lrs
    assert [r.outcome for r in t.audit()] == ["pass"] * 4


def test_a_record_whose_lr_does_not_follow_the_warmup_fails() -> None:
    t = Trainer(run_settings(warmup_steps=3))
    t.step()
    t.step(lr=LR)  # no warmup on step 2, and the record says so
    results = t.audit()
    assert [r.outcome for r in results] == ["pass", "fail"], results
    assert "the run's schedule gives step 2" in results[1].reason


def test_a_scale_the_previous_step_did_not_make_fails() -> None:
    t = Trainer(run_settings(target_kl=1e-3))
    t.step()
    t.step()
    t.step(lr_scale=4.0)  # within the bounds, and trained at it, but not what step 2's KL makes
    results = t.audit()
    assert [r.outcome for r in results] == ["pass", "pass", "fail"], results
    assert "previous step's KL" in results[2].reason


def test_a_scale_out_of_bounds_or_without_a_target_fails() -> None:
    t = Trainer(run_settings())
    t.step(lr_scale=2.0)
    results = t.audit()
    assert results[0].outcome == "fail" and "lr_scale" in results[0].reason, results
