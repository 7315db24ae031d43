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
    model.eval()
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
