"""The optimizer step on a tiny random Llama: micro-batching is exact, and GRPO learns a toy reward."""

from __future__ import annotations

import pytest
import torch

from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, collate, make_optimizer, train_step
from tests.support.grpo import sample_group, tiny_llama

torch.set_num_threads(1)


def _samples(model: object, prompts: list[list[int]], g: int, reward_tok: int, seed: int) -> list[Sample]:
    out: list[Sample] = []
    for j, prompt in enumerate(prompts):
        for comp, lps in sample_group(model, prompt, g, new_tokens=3, seed=seed + j):
            out.append(Sample(tuple(prompt), tuple(comp), tuple(lps), float(comp[0] == reward_tok)))
    return out


def test_collate_aligns_logprobs_with_the_logits_that_predict_them() -> None:
    s = Sample((5, 6), (7, 8, 9), (-0.1, -0.2, -0.3), 1.0)
    t = Sample((5,), (7,), (-0.5,), 0.0)
    tb = collate([s, t], torch.tensor([0.5, -0.5]), pad_id=0)
    assert tb.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert tb.loss_mask.tolist() == [[False, True, True, True, False], [True, False, False, False, False]]
    assert tb.old_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0])
    assert tb.attention_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    with pytest.raises(ValueError):
        collate([Sample((5,), (7, 8), (-0.1,), 0.0)], torch.tensor([0.0]))


def test_micro_batches_give_the_full_batch_step() -> None:
    # SGD, so parameters compare the assembled gradients directly: Adam's first step is ~lr * sign(g),
    # which turns a 1e-9 float-order difference on a near-zero gradient into an lr-sized one.
    cfg = GRPOConfig(group_size=4, token_budget=64, max_grad_norm=1.0)
    a, b = tiny_llama(seed=1), tiny_llama(seed=1)
    samples = _samples(a, [[1, 3], [1, 4, 5]], 4, reward_tok=6, seed=0)
    samples = [Sample(s.prompt_ids, s.completion_ids, s.old_logprobs, float(i % 3 == 0))
               for i, s in enumerate(samples)]
    sa = train_step(a, torch.optim.SGD(a.parameters(), lr=1.0), samples, cfg, micro_batch=64)
    sb = train_step(b, torch.optim.SGD(b.parameters(), lr=1.0), samples, cfg, micro_batch=3)
    assert sa.grad_norm == pytest.approx(sb.grad_norm, rel=1e-5)
    assert sa.loss == pytest.approx(sb.loss, abs=1e-6)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-7), n
    assert sa.tokens == 8 * 3 and sa.samples == 8


def test_whole_groups_required() -> None:
    m = tiny_llama()
    with pytest.raises(ValueError, match="whole groups"):
        train_step(m, make_optimizer(m, 1e-3), [Sample((1,), (2,), (-1.0,), 1.0)] * 3,
                   GRPOConfig(group_size=2))


def test_grpo_raises_the_probability_of_the_rewarded_token() -> None:
    torch.manual_seed(0)
    model = tiny_llama(seed=2)
    prompt = [1, 3]
    target = 6

    def p_target() -> float:
        with torch.no_grad():
            return float(torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)[target])

    before = p_target()
    cfg = GRPOConfig(group_size=8, token_budget=4 * 8 * 3, max_grad_norm=1.0)
    opt = make_optimizer(model, 3e-3)
    for step in range(25):
        model.eval()
        samples = _samples(model, [prompt] * 4, 8, reward_tok=target, seed=100 * step)
        stats = train_step(model, opt, samples, cfg)
        # On-policy samples: the ratio starts at exactly 1 (same weights, same fp32 math).
        assert stats.ratio_mean == pytest.approx(1.0, abs=1e-4)
    after = p_target()
    assert after > max(0.5, 3 * before), (before, after)
