"""Random-weight Hugging Face model folders of the real families, built offline.

Nothing can be downloaded in tests, benchmarks or the GPU check, yet they need models with the shapes
and files of real ones: a ``config.json`` of the family made by transformers' own config class, weights
written by ``save_pretrained`` (safetensors), a byte-level BPE tokenizer trained here by ``tokenizers``
with the family's special tokens and a ChatML chat template, and ``generation_config.json`` with two
EOS IDs (end of turn, end of text) as instruct models ship.

Sizes (:data:`SIZES`): ``tiny`` (~0.3M parameters, tests), ``50m`` (~55M, ``bench/rollouts.py``).
Weights are random: outputs are noise, which is all throughput and proof checks need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SIZES: dict[str, dict[str, int]] = {
    # tiny: hidden 128, not less: a TOPLOC proof chunk of a one-token completion holds hidden_size values
    # and needs the top-k's 128 (with 64, a completion that is one EOS fails its worker's whole batch).
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512},
    "50m": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 8192},
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, the template of the Qwen families (Llama and Mistral folders here use it too: what matters
to the node is that the folder carries a template, not which one)."""


def _corpus() -> list[str]:
    """Text to train the BPE on: arithmetic, a little English, the chat markup's words."""
    words = ("the answer is a number think step by step what solve compute sum product equals question "
             "user assistant system reasoning puzzle letter word count sort list graph").split()
    lines = [f"{a} + {b} = {a + b}. {a} * {b} = {a * b}." for a in range(0, 200, 7) for b in range(0, 50, 3)]
    lines += [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    return lines * 4


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE with the special tokens first (IDs 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def family_config(family: str, size: str = "tiny", *, tied: bool | None = None,
                  max_positions: int = 2048) -> Any:
    """transformers' config of ``family`` at ``size`` (Llama with Llama-3 RoPE scaling, Qwen2 with its
    QKV bias, Qwen3 with q/k norms; the class adds them). ``tied``: default untied for ``50m``."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    dims = dict(SIZES[size])
    common: dict[str, Any] = {**dims, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
                              "tie_word_embeddings": (size == "tiny") if tied is None else tied,
                              "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}
    if family == "llama":
        common["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        common["rope_theta"] = 500000.0
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.MistralConfig(**common)


def make_model(dst: str | Path, family: str, size: str = "tiny", *, seed: int = 0, tied: bool | None = None,
               dtype: str = "float32") -> Path:
    """Write a random-weight ``family`` model folder of ``size`` to ``dst``; returns ``dst``."""
    import torch
    import transformers

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = family_config(family, size, tied=tied)
    tok = train_tokenizer(min(cfg.vocab_size, 4096))
    torch.manual_seed(seed)
    # transformers leaves from_config and the fast tokenizer's constructor unannotated.
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: perturb them too
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(dst, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(dst)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
           "do_sample": True}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return dst


def parse_spec(spec: str) -> tuple[str, str]:
    """``qwen3-50m`` -> (``qwen3``, ``50m``); ``llama`` -> (``llama``, ``tiny``)."""
    family, _, size = spec.partition("-")
    return family, size or "tiny"
