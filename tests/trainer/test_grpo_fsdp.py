"""FSDP2 (``fully_shard``) under torchrun with 2 gloo processes on the CPU equals the 1-process step, and
its checkpoints are the single-process format (a sharded run resumes a one-process checkpoint, and back)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from intellect_node.trainer.distributed import samples_to_json
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.step import Sample, micro_batches, train_step
from tests.support.grpo import scored_samples, tiny_family_model, torchrun

torch.set_num_threads(1)
pytestmark = pytest.mark.slow  # two torchrun launches per test

MICRO_TOKENS = 12


def _batch(model: torch.nn.Module) -> list[Sample]:
    """12 samples whose completions are cut to 1..4 tokens by index, so rank 0 (even indexes: short)
    and rank 1 (odd: long) need different numbers of micro-steps under a token budget."""
    out = []
    for i, s in enumerate(scored_samples(model, [[1, 3], [1, 4, 5], [1, 7]], 4, seed=3, new_tokens=4)):
        n = 1 + (i % 2) * 2 + (i % 4 == 3)
        out.append(Sample(s.prompt_ids, s.completion_ids[:n], s.old_logprobs[:n], s.reward))
    return out


def _close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float) -> None:
    assert set(got) == set(ref)
    for k, v in got.items():
        assert torch.allclose(v, ref[k], atol=atol), (k, float((v - ref[k]).abs().max()))


def test_fsdp2_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    tiny_family_model("qwen3", seed=7).save_pretrained(tmp_path / "model")
    model = load_trainable(tmp_path / "model")
    samples = _batch(model)
    shards = [samples[r::2] for r in range(2)]
    counts = [len(micro_batches(s, micro_tokens=MICRO_TOKENS)) for s in shards]
    assert counts[0] != counts[1]  # the ranks run filler passes to stay in lockstep
    (tmp_path / "batch.json").write_text(samples_to_json(samples))
    torchrun(2, "--strategy", "fsdp", "--model-dir", str(tmp_path / "model"), "--batch",
             str(tmp_path / "batch.json"), "--optimizer", "sgd", "--lr", "0.5", "--group-size", "4",
             "--token-budget", "48", "--max-grad-norm", "1.0", "--steps", "2", "--micro-tokens",
             str(MICRO_TOKENS), "--out-dir", str(tmp_path / "fsdp2"))

    cfg = GRPOConfig(group_size=4, token_budget=48, max_grad_norm=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = [train_step(model, opt, samples, cfg) for _ in range(2)]
    out = tmp_path / "fsdp2" / "v00000002"
    _close(load_file(str(out / "model.safetensors")), {k: v.detach() for k, v in model.state_dict().items()},
           atol=2e-6)
    extra = json.loads((out / "state.json").read_text())["extra"]
    assert extra["strategy"] == "fsdp" and extra["world_size"] == 2
    for got, ref in zip(extra["loss"], stats):
        assert abs(got - ref.loss) < 1e-6
    for got, ref in zip(extra["grad_norm"], stats):
        assert abs(got - ref.grad_norm) < 1e-5 * max(1.0, ref.grad_norm)


def test_fsdp2_resumes_a_one_process_adamw_checkpoint_and_writes_one(tmp_path: Path) -> None:
    tiny_family_model("llama", seed=5).save_pretrained(tmp_path / "model")
    model = load_trainable(tmp_path / "model")
    samples = _batch(model)
    (tmp_path / "batch.json").write_text(samples_to_json(samples))
    cfg = GRPOConfig(group_size=4, token_budget=48, max_grad_norm=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, samples, cfg)
    save_checkpoint(tmp_path / "ck", model, opt, TrainerState(version=1, step=1))
    torchrun(2, "--strategy", "fsdp", "--model-dir", str(tmp_path / "model"), "--checkpoint-dir",
             str(tmp_path / "ck"), "--batch", str(tmp_path / "batch.json"), "--optimizer", "adamw",
             "--lr", "1e-3", "--group-size", "4", "--token-budget", "48", "--max-grad-norm", "1.0",
             "--out-dir", str(tmp_path / "fsdp2"))

    train_step(model, opt, samples, cfg)  # the same second step in one process
    resumed = load_trainable(tmp_path / "model")
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    state = load_checkpoint(tmp_path / "fsdp2", resumed, resumed_opt)
    assert state is not None and state.version == 2
    _close(dict(resumed.state_dict()), dict(model.state_dict()), atol=1e-5)
    for p, q in zip(resumed.parameters(), model.parameters()):
        a, b = resumed_opt.state[p], opt.state[q]
        assert float(a["step"]) == float(b["step"]) == 2.0
        assert torch.allclose(a["exp_avg"], b["exp_avg"], atol=1e-7)
        assert torch.allclose(a["exp_avg_sq"], b["exp_avg_sq"], atol=1e-9, rtol=1e-4)
