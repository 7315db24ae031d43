"""The step under torchrun with 2 gloo processes on the CPU equals the 1-process step."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from intellect_node.trainer.distributed import samples_from_json, samples_to_json
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, train_step
from tests.support.grpo import sample_group, tiny_llama, torchrun

torch.set_num_threads(1)


def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    model = tiny_llama(seed=7)
    model.save_pretrained(tmp_path / "model")
    samples: list[Sample] = []
    for j, prompt in enumerate([[1, 3], [1, 4, 5], [1, 7]]):
        for i, (comp, lps) in enumerate(sample_group(model, prompt, 4, new_tokens=3 + j, seed=j)):
            samples.append(Sample(tuple(prompt), tuple(comp), tuple(lps), float((i + j) % 3 == 0)))
    batch = tmp_path / "batch.json"
    batch.write_text(samples_to_json(samples))
    assert samples_from_json(batch.read_text()) == samples
    common = ["--model-dir", str(tmp_path / "model"), "--batch", str(batch), "--optimizer", "sgd",
              "--lr", "0.5", "--group-size", "4", "--token-budget", "48", "--max-grad-norm", "1.0",
              "--steps", "2"]
    torchrun(2, *common, "--out-dir", str(tmp_path / "ddp2"))

    # The reference: the plain single-process step, twice, in this process. (SGD: parameters then
    # compare the gradients themselves; see test_grpo_step for why not Adam's sign-like first step.)
    cfg = GRPOConfig(group_size=4, token_budget=48, max_grad_norm=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        train_step(model, opt, samples, cfg)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    got = load_file(str(tmp_path / "ddp2" / "v00000002" / "model.safetensors"))
    assert set(got) == set(ref)
    moved = sum(float((ref[k] - v).abs().sum()) for k, v in load_file(
        str(tmp_path / "model" / "model.safetensors")).items())
    assert moved > 1e-3  # the steps did change the weights
    for k, v in got.items():
        assert torch.allclose(v, ref[k], atol=2e-6), (k, float((v - ref[k]).abs().max()))
