"""``rl.micro_batch_tokens`` is each node's own, so an auditor whose value differs from
the trainer's still passes the trainer's honest steps: the replay uses the record's micro-batching (which
fixes the summation order, hence the bits), and does not fail the record for it."""

from __future__ import annotations

import torch

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.steps import StepBatch, StepRecord, StepSettings, check_record
from intellect_node.roles.auditor.replay import WindowReplay, weights_hash
from intellect_node.roles.common.grpo import grpo_config_of, settings_of
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import make_optimizer, train_step
from tests.support.grpo import scored_samples, tiny_llama

torch.set_num_threads(1)

GROUP = 4


def _settings(micro_tokens: int | None) -> StepSettings:
    return settings_of(GRPOConfig(group_size=GROUP, token_budget=64, max_grad_norm=1.0), lr=1e-2,
                       temperature=1.0, micro_tokens=micro_tokens, compute_dtype=None)


def test_a_trainer_with_other_micro_batch_tokens_than_the_auditor_passes() -> None:
    samples = scored_samples(tiny_llama(seed=100), [[1, 3, 5], [1, 4]], GROUP, seed=0)
    groups = [samples[i:i + GROUP] for i in range(0, len(samples), GROUP)]
    mine = _settings(16)  # the trainer's: micro-batches of 2 rows
    model = tiny_llama(seed=5)
    base = weights_hash(model)
    train_step(model, make_optimizer(model, mine.lr), samples, grpo_config_of(mine), micro_tokens=16)
    batch = StepBatch(cid=cid_of(b"batch"), worker="12D3KooWworker", groups=2, trained=[0, 1])
    rec = check_record(StepRecord(run_id="micro", seq=1, step=1, base_version=0, base_hash=base, version=1,
                                  checkpoint_hash=weights_hash(model), batches=[batch], settings=mine))
    auditor = _settings(16384)  # the auditor's own rl.micro_batch_tokens: one micro-batch for all
    result = WindowReplay(tiny_llama(seed=5), auditor).audit(rec, lambda b: groups)
    assert result.outcome == "pass", result


def test_the_record_value_is_what_makes_the_bits() -> None:
    samples = scored_samples(tiny_llama(seed=100), [[1, 3, 5], [1, 4]], GROUP, seed=0)
    hashes = set()
    for micro in (16, 16384):
        model = tiny_llama(seed=5)
        s = _settings(micro)
        train_step(model, make_optimizer(model, s.lr), samples, grpo_config_of(s), micro_tokens=micro)
        hashes.add(weights_hash(model))
    assert len(hashes) == 2  # another summation order: other bits, so the replay must take the record's
