"""Helpers for the GRPO tests: a tiny random Llama built in-process (no files, no hub)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(vocab: int = 16, hidden: int = 32, layers: int = 2, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    model.train(False)  # eval mode (transformers leaves eval() untyped)
    return model


@torch.no_grad()
def sample_group(model: Any, prompt: list[int], n: int, new_tokens: int,
                 seed: int) -> list[tuple[list[int], list[float]]]:
    """Sample ``n`` completions of ``prompt`` at temperature 1 with their token logprobs (no cache)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * n)
    lps: list[list[float]] = [[] for _ in range(n)]
    for _ in range(new_tokens):
        logits = model(input_ids=ids).logits[:, -1, :].float()
        logp = torch.log_softmax(logits, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        for i in range(n):
            lps[i].append(float(logp[i, tok[i, 0]]))
        ids = torch.cat([ids, tok], dim=1)
    return [(ids[i, len(prompt):].tolist(), lps[i]) for i in range(n)]


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_family_model(family: str, *, vocab: int = 32, hidden: int = 64, layers: int = 2, seed: int = 0,
                      tied: bool = False) -> Any:
    """A tiny random causal LM of ``family`` with the feature that sets it apart switched on: Llama-3
    rope scaling, Mistral's sliding window, Qwen2's QKV bias, Qwen3's q/k norms (and explicit head_dim)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        # rope_scaling: the transformers 4 key, which transformers 5 still reads into rope_parameters.
        cfg: Any = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0,  # type: ignore[call-arg]  # transformers 4's keys, which transformers 5 still reads
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 32})
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=8)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]  # untyped in transformers
    model.eval()
    return model


def scored_samples(model: Any, prompts: list[list[int]], group: int, *, seed: int = 0,
                   new_tokens: int = 3) -> list[Any]:
    """Whole groups of sampled completions with their logprobs and mixed rewards (some groups of
    different lengths, so micro-batches pad)."""
    from intellect_node.trainer.step import Sample

    out = []
    for j, prompt in enumerate(prompts):
        for i, (comp, lps) in enumerate(sample_group(model, prompt, group, new_tokens=new_tokens + j,
                                                     seed=seed + j)):
            out.append(Sample(tuple(prompt), tuple(comp), tuple(lps), float((i + j) % 3 == 0)))
    return out


def torchrun(nproc: int, *args: str, timeout: float = 240) -> None:
    """``python -m torch.distributed.run --standalone`` of the trainer's distributed entry point."""
    import os
    import subprocess
    import sys

    from tests.support.common import REPO

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", "-m", "intellect_node.trainer.distributed", *args]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]


def replayed_hash(root: Any, *, fresh: bool) -> str:
    """The content hash after three training steps past a checkpoint under ``root``. ``fresh``: from
    seeded weights, one warm-up step (AdamW has state) and the checkpoint written; otherwise from other
    weights with that checkpoint (weights and AdamW state) loaded. One torch thread, as the trainer's
    bitwise replay needs."""
    from intellect_node.policy.weights import PolicyWeights
    from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from intellect_node.trainer.grpo import GRPOConfig
    from intellect_node.trainer.step import Sample, make_optimizer, train_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = tiny_llama(seed=3 if fresh else 9)  # the resumed one starts from other weights
        opt = make_optimizer(m, 1e-2)
        cfg = GRPOConfig(group_size=4, token_budget=16, max_grad_norm=1.0)
        if fresh:
            warm = [Sample((1, 3), (4, 5), (-2.0, -2.5), float(i % 2)) for i in range(4)]
            train_step(m, opt, warm, cfg)  # AdamW has state before the checkpoint
            save_checkpoint(root, m, opt, TrainerState(version=1))
        else:
            assert load_checkpoint(root, m, opt) is not None
        for k in range(3):  # the journaled steps after the checkpoint
            batch = [Sample((1, 2 + k, 3), (4 + i, 5, 6), (-2.0, -2.5 + 0.1 * i, -1.0), float(i % 3 == 0))
                     for i in range(8)]
            train_step(m, opt, batch, cfg)
        return PolicyWeights.from_state_dict(m.state_dict()).content_hash
    finally:
        torch.set_num_threads(threads)
