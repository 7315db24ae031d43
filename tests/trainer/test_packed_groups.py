"""Shared prompts in the trainer's step (``step.pack_groups``): one row per group gives every completion
token the log-probability, and the step the loss and gradients, that padded rows give; for every family
(Mistral's sliding window crossed), with the KL and entropy terms and a temperature, whole or in
micro-batches of groups; batches that cannot share their prompt train padded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.lean import LeanCausalLM
from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.step import (
    Sample,
    accumulate_gradients,
    batch_advantages,
    make_optimizer,
    micro_batches,
    pack_groups,
    packable,
    train_step,
)
from tests.support.grpo import FAMILIES, tiny_family_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        model = tiny_family_model(family, seed=11)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p += 0.05 * torch.randn(p.shape, generator=g)
        model.save_pretrained(path)
        out[family] = path
    return out


def _groups(group_size: int, prompts: list[int], seed: int) -> list[Sample]:
    """Groups with prompts of the given lengths and completions of 1 to 9 tokens (rows reach past
    Mistral's window of 8); old logprobs near the model's, rewards mixed."""
    rng = random.Random(seed)
    out = []
    for p in prompts:
        prompt = tuple(rng.randrange(3, 32) for _ in range(p))
        for _ in range(group_size):
            comp = tuple(rng.randrange(0, 32) for _ in range(rng.randrange(1, 10)))
            out.append(Sample(prompt, comp, tuple(-3.4 + rng.uniform(-0.3, 0.3) for _ in comp),
                              float(rng.random() < 0.4)))
    return out


def test_a_group_is_one_row_the_prompt_then_each_completion_but_its_last_token() -> None:
    a = Sample((5, 6, 7), (8, 9), (-0.1, -0.2), 1.0)
    b = Sample((5, 6, 7), (10,), (-0.3,), 0.0)
    c = Sample((4,), (11, 12, 13), (-0.4, -0.5, -0.6), 0.0)
    d = Sample((4,), (14, 15), (-0.7, -0.8), 1.0)
    pb = pack_groups([a, b, c, d], torch.tensor([0.5, -0.5, -0.5, 0.5]), group_size=2, pad_id=0)
    assert pb.input_ids.tolist() == [[5, 6, 7, 8], [4, 11, 12, 14]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 1]]
    # Each completion token is predicted from the prompt's last slot or from its own previous token.
    assert list(zip(pb.rows.tolist(), pb.slots.tolist(), pb.targets.tolist())) == [
        (0, 2, 8), (0, 3, 9), (0, 2, 10), (1, 0, 11), (1, 1, 12), (1, 2, 13), (1, 0, 14), (1, 3, 15)]
    assert pb.old_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8])
    assert pb.advantages.tolist() == [0.5, 0.5, -0.5, -0.5, -0.5, -0.5, 0.5, 0.5]
    # Row 1: the second completion (slot 3) sees the prompt and itself, not the first completion.
    assert pb.allowed[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    # Row 0's pad-free width is 4; a pad slot would see the prompt (no empty row), no real slot sees it.
    assert pb.allowed[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="another prompt"):
        pack_groups([a, c], torch.zeros(2), group_size=2)


def _step_parts(model: LeanCausalLM, samples: list[Sample], cfg: GRPOConfig, *, packed: bool,
                micro_batch: int = 64, ref: LeanCausalLM | None = None,
                temperature: float = 1.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    parts = accumulate_gradients(model, samples, batch_advantages(samples, cfg), cfg, micro_batch=micro_batch,
                                 ref_model=ref, temperature=temperature, packed=packed)
    totals = [sum(float(p.loss.detach()) for p in parts), sum(p.tokens for p in parts),
              sum(p.kl for p in parts), sum(p.entropy for p in parts),
              sum(p.clipped_frac * p.tokens for p in parts)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return totals, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_groups_give_the_padded_loss_and_gradients(family: str, folders: dict[str, Path]) -> None:
    model = load_trainable(folders[family])
    ref = load_trainable(folders[family])
    assert isinstance(model, LeanCausalLM) and isinstance(ref, LeanCausalLM)
    with torch.no_grad():  # the reference differs, so the KL term is not zero
        for p in ref.parameters():
            p.mul_(0.9)
    samples = _groups(4, [3, 7, 1], seed=5)
    assert packable(samples, 4)
    cfg = GRPOConfig(group_size=4, token_budget=64, max_grad_norm=1.0, kl_coef=0.1, entropy_coef=0.01)
    padded, g_padded = _step_parts(model, samples, cfg, packed=False, ref=ref, temperature=0.8)
    for micro_batch in (64, 4, 6):  # whole, a group each, and a cut that must round down to groups
        packed, g_packed = _step_parts(model, samples, cfg, packed=True, ref=ref, temperature=0.8,
                                       micro_batch=micro_batch)
        assert packed[1] == padded[1] == sum(len(s.completion_ids) for s in samples)
        assert packed == pytest.approx(padded, rel=1e-4, abs=1e-6), (family, micro_batch)
        assert g_packed.keys() == g_padded.keys()
        for name, g in g_padded.items():
            assert torch.allclose(g_packed[name], g, rtol=1e-4, atol=1e-6), (family, name, micro_batch)


def test_micro_batches_of_packed_groups_cut_between_groups() -> None:
    samples = _groups(4, [3, 7, 1, 2], seed=1)
    assert micro_batches(samples, micro_batch=8, group_size=4) == [range(0, 8), range(8, 16)]
    assert micro_batches(samples, micro_batch=3, group_size=4) == [range(i, i + 4) for i in range(0, 16, 4)]
    # A token budget counts packed slots: groups x the longest packed row.
    widths = [len(samples[i].prompt_ids) + sum(len(s.completion_ids) - 1 for s in samples[i:i + 4])
              for i in range(0, 16, 4)]
    cuts = micro_batches(samples, micro_batch=64, micro_tokens=2 * max(widths), group_size=4)
    assert [r.start for r in cuts][0] == 0 and cuts[-1].stop == 16
    assert all(r.start % 4 == 0 and r.stop % 4 == 0 for r in cuts)
    for r in cuts:
        groups = range(r.start // 4, r.stop // 4)
        assert len(groups) == 1 or len(groups) * max(widths[g] for g in groups) <= 2 * max(widths)


def test_train_step_packs_only_what_shares_a_prompt_and_trains_either_way(folders: dict[str, Path]) -> None:
    cfg = GRPOConfig(group_size=4, token_budget=64, max_grad_norm=1.0)
    same = _groups(4, [5, 2], seed=3)
    other = Sample((9, 9), same[3].completion_ids, same[3].old_logprobs, same[3].reward)
    mixed = same[:3] + [other] + same[4:]
    assert packable(same, 4) and not packable(mixed, 4)
    assert not packable(same, 4, limit=5)  # a row over the limit
    long_tail = [Sample(s.prompt_ids, s.completion_ids * 80, s.old_logprobs * 80, s.reward) for s in same]
    assert not packable(long_tail, 4)  # long completions: rows past PACK_ROW_LIMIT
    for batch in (same, mixed):
        weights = []
        for pack in (True, False):
            m = load_trainable(folders["llama"])
            stats = train_step(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, cfg, pack=pack)
            assert stats.tokens == sum(len(s.completion_ids) for s in batch)
            weights.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
        assert torch.allclose(weights[0], weights[1], rtol=1e-4, atol=1e-6)
    m = load_trainable(folders["qwen3"])
    stats = train_step(m, make_optimizer(m, 1e-3), same, cfg)
    assert stats.samples == 8 and stats.ratio_mean > 0
