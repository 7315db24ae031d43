"""The trainer on every supported family (tiny random models saved as HF folders, loaded back through
``trainer.model.load_trainable``): one GRPO step equals a hand-written reference step, bf16 keeps fp32
master weights, gradient checkpointing gives the same gradients, micro-batches hold their token budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from intellect_node.errors import ConfigError
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.model import TrainOptions, is_checkpointing, load_trainable
from intellect_node.trainer.step import (
    Sample,
    accumulate_gradients,
    batch_advantages,
    micro_batches,
    train_step,
)
from tests.support.grpo import FAMILIES, scored_samples, tiny_family_model

torch.set_num_threads(1)

PROMPTS = [[1, 3, 4, 5, 6, 7], [1, 9], [1, 4, 8, 10]]
"""Different prompt lengths and 3..5 new tokens: rows up to 11 tokens pad against each other and pass
Mistral's sliding window of 8."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        tiny_family_model(family, seed=3, tied=family == "qwen2").save_pretrained(path)
        out[family] = path
    return out


def _offpolicy(samples: list[Sample], seed: int) -> list[Sample]:
    """Shift pi_old away from the current policy so the ratio leaves [0.8, 1.2] and hits the delta cap."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        noise = (torch.rand(len(s.old_logprobs), generator=g) * 3.0 - 1.5).tolist()
        out.append(Sample(s.prompt_ids, s.completion_ids, tuple(a + b for a, b in zip(s.old_logprobs, noise)),
                          s.reward))
    return out


def _reference_step(model: torch.nn.Module, samples: list[Sample], cfg: GRPOConfig, lr: float) -> None:
    """GRPO written out sample by sample (unpadded forward, no masks): the INTELLECT-2 loss, the global
    norm clip and a plain SGD update."""
    rewards = [s.reward for s in samples]
    total = torch.zeros(())
    for k, s in enumerate(samples):
        group = rewards[k - k % cfg.group_size: k - k % cfg.group_size + cfg.group_size]
        a = s.reward - sum(group) / len(group)
        ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
        logits = model(input_ids=ids).logits[0].float()
        p, c = len(s.prompt_ids), len(s.completion_ids)
        targets = torch.tensor(s.completion_ids)[:, None]
        lp = torch.log_softmax(logits[p - 1:p - 1 + c], -1).gather(-1, targets)[:, 0]
        ratio = torch.exp(lp - torch.tensor(s.old_logprobs))
        clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
        unclipped = torch.clamp(ratio, max=cfg.neg_ratio_cap) if a < 0 else ratio
        total = total - torch.minimum(unclipped * a, clipped * a).sum()
    torch.autograd.backward(total / cfg.token_budget)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum(((g.double() ** 2).sum() for g in grads), torch.tensor(0.0, dtype=torch.float64)))
    coef = min(1.0, cfg.max_grad_norm / (float(norm) + 1e-6))
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.sub_(lr * coef * param.grad)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_equals_the_hand_written_reference(family: str, folders: dict[str, Path]) -> None:
    model = load_trainable(folders[family])
    ref = load_trainable(folders[family])
    samples = _offpolicy(scored_samples(model, PROMPTS, 4, seed=11), seed=5)
    cfg = GRPOConfig(group_size=4, token_budget=60, max_grad_norm=1.0)
    # A 24-token budget cuts the 12 rows into several padded micro-batches.
    plan = micro_batches(samples, micro_tokens=24)
    assert len(plan) > 3
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), samples, cfg, micro_tokens=24)
    assert 0 < stats.clipped_frac < 1  # the clip and the cap were exercised
    _reference_step(ref, samples, cfg, lr=1.0)
    before = tiny_family_model(family, seed=3, tied=family == "qwen2").state_dict()
    moved = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=2e-6), (family, name, float((p - q).abs().max()))
        moved += float((p.detach() - before[name]).abs().sum())
    assert moved > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights(family: str, folders: dict[str, Path]) -> None:
    opts = TrainOptions(dtype="bfloat16")
    model = load_trainable(folders[family], opts)
    fp32 = load_trainable(folders[family])
    samples = scored_samples(fp32, PROMPTS, 4, seed=2)
    cfg = GRPOConfig(group_size=4, token_budget=60, max_grad_norm=1.0)
    seen: list[torch.dtype] = []
    head = model.lm_head
    assert isinstance(head, torch.nn.Module)
    hook = head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    adv = batch_advantages(samples, cfg)
    accumulate_gradients(model, samples, adv, cfg, compute_dtype=opts.compute_dtype)
    accumulate_gradients(fp32, samples, adv, cfg)
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)
    for (name, p), q in zip(model.named_parameters(), fp32.parameters()):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert q.grad is not None
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert float(cos) > 0.95, (family, name, float(cos))
    # A whole AdamW step: weights and optimizer state stay fp32 and the weights move.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = train_step(model, opt, samples, cfg, compute_dtype=opts.compute_dtype)
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(t.dtype == torch.float32 for st in opt.state.values() for t in st.values() if t.dim())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family: str, folders: dict[str, Path]) -> None:
    plain = load_trainable(folders[family])
    ckpt = load_trainable(folders[family], TrainOptions(gradient_checkpointing=True))
    assert is_checkpointing(ckpt) and not is_checkpointing(plain)
    samples = _offpolicy(scored_samples(plain, PROMPTS, 4, seed=4), seed=1)
    cfg = GRPOConfig(group_size=4, token_budget=60)
    adv = batch_advantages(samples, cfg)
    for m in (plain, ckpt):
        m.train()
        accumulate_gradients(m, samples, adv, cfg, micro_tokens=40)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), (family, name)


def test_micro_batches_hold_the_token_budget_and_the_row_cap() -> None:
    lengths = [3, 9, 4, 4, 12, 2, 2, 2, 2, 7]
    samples = [Sample((1,) * (n - 1), (5,), (-1.0,), 0.0) for n in lengths]
    for budget in (1, 8, 12, 20, 40, 1000):
        for cap in (1, 2, 3, 64):
            plan = micro_batches(samples, micro_batch=cap, micro_tokens=budget)
            assert [i for r in plan for i in r] == list(range(len(samples)))  # in order, each once
            for r in plan:
                width = max(lengths[i] for i in r)
                assert len(r) <= cap
                assert len(r) * width <= budget or len(r) == 1  # a single long row stands alone
    assert [len(r) for r in micro_batches(samples, micro_tokens=24)] == [2, 2, 2, 3, 1]
    assert micro_batches(samples) == [range(0, 10)]


def test_other_architectures_and_non_folders_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_trainable(tmp_path)
    with pytest.raises(ConfigError, match="needs config.json"):
        load_trainable(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="float32, bfloat16"):
        TrainOptions(dtype="float16")
    with pytest.raises(ConfigError, match="cuda:N"):
        TrainOptions(device="gpu0")


def test_the_embedded_model_loads_for_training() -> None:
    model = load_trainable(None)
    assert type(model).__name__ == "LeanCausalLM" and model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
