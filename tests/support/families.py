"""Tiny random-weight models of every supported family, saved as Hugging Face folders (nothing downloaded).

Each folder holds what a real checkpoint holds: ``config.json`` written by transformers' own config class,
safetensors weights (one file, or shards with an index), a byte-level BPE ``tokenizer.json`` trained here
by ``tokenizers`` on :data:`TEXT`, ``tokenizer_config.json`` with the family's special tokens and a chat
template in its style, and ``generation_config.json`` with the family's EOS IDs (two for the chat families,
as Qwen and Llama 3 ship them). Weights are random but not transformers' near-zero init: biases and norm
weights are perturbed too, so a runner that skipped a bias or a q/k norm would disagree with the reference.

:func:`family_model` builds each variant once per test process (cached in a temporary folder removed at
exit); tests that change weights copy it first.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

TEXT = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
A worker samples completions, a validator checks their proofs, and a trainer learns from the accepted ones.
What is 12 + 45? The answer is 57. What is 123 + 456? The answer is 579. Think step by step.
<answer>42</answer> \\boxed{7} Let x = 3; then 2x + 1 = 7. Sums, products, fractions: 1/2 + 1/3 = 5/6.
You are a helpful assistant. Answer the question and put the final answer in the box.
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'"()[]{}<>+-*/=_#%&@$^~|\\
"""
"""Training text of the test tokenizers: English, arithmetic, answer markup and every printable character
(the byte-level alphabet covers any input; merges come from this text)."""

VOCAB = 384

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_CHAT = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
                "{% set head = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
                "{% else %}{% set head = '' %}{% set turns = messages %}{% endif %}"
                "{% for m in turns %}{% if m['role'] == 'user' %}[INST] {{ head if loop.first }}"
                "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
                "{% endfor %}")

SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             rms_norm_eps=1e-6, initializer_range=0.1)
"""A few hundred thousand parameters: big enough for grouped-query attention and two layers, small
enough that building all variants takes a second or two."""

VARIANTS = ("llama", "llama-sharded", "mistral", "qwen2", "qwen3")
"""``llama``: Llama 3 style (llama3 RoPE scaling, two EOS IDs); ``llama-sharded``: the same weights in
three safetensors shards with an index; ``mistral``: a sliding window shorter than the tests' sequences;
``qwen2``: QKV biases; ``qwen3``: q/k norms, tied embeddings, head_dim != hidden / heads."""

_ROOT: list[Path] = []


def train_tokenizer(specials: list[str]) -> Any:
    """A byte-level BPE tokenizer trained on :data:`TEXT`; the special tokens take the first IDs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    return tok


def _family_files(kind: str) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(tokenizer, model config kwargs, tokenizer_config, generation_config) for a family."""
    if kind in ("qwen2", "qwen3"):
        tok = train_tokenizer(QWEN_SPECIALS)
        ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
        cfg = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                   pad_token_id=ids["<|endoftext|>"])
        tok_cfg: dict[str, Any] = dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                       chat_template=CHATML)
        gen = dict(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    elif kind == "llama":
        tok = train_tokenizer(LLAMA_SPECIALS)
        ids = {t: tok.token_to_id(t) for t in LLAMA_SPECIALS}
        cfg = dict(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"])
        tok_cfg = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_CHAT)
        gen = dict(bos_token_id=ids["<|begin_of_text|>"],
                   eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]])
    else:
        tok = train_tokenizer(MISTRAL_SPECIALS)
        ids = {t: tok.token_to_id(t) for t in MISTRAL_SPECIALS}
        cfg = dict(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
        tok_cfg = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=MISTRAL_CHAT)
        gen = dict(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,
               "clean_up_tokenization_spaces": False, **tok_cfg}
    return tok, cfg, tok_cfg, gen


def _config(kind: str, vocab: int, ids: dict[str, Any], shape: dict[str, Any] = SHAPE) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        # rope_theta and rope_scaling: transformers 4's keys, which transformers 5 still reads.
        return LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, rope_theta=10000.0,  # type: ignore[call-arg]  # transformers 4's keys, which transformers 5 still reads
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                           **shape, **ids)
    if kind == "mistral":
        return MistralConfig(vocab_size=vocab, tie_word_embeddings=False, sliding_window=12,
                             **{"head_dim": 16, **shape}, **ids)  # a shape may set head_dim (vLLM: >= 32)
    if kind == "qwen2":
        return Qwen2Config(vocab_size=vocab, tie_word_embeddings=False, use_sliding_window=False, **shape,
                           **ids)
    return Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, head_dim=32, attention_bias=False,
                       use_sliding_window=False, **shape, **ids)


def build_family_model(kind: str, dst: Path, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    """Write a random ``kind`` model (one of :data:`VARIANTS`) to ``dst`` and return it. ``shape``:
    settings over :data:`SHAPE` (a swarm run wants ``hidden_size`` >= TOPLOC's top-k of 128, since a
    one-token completion's proof chunk holds only ``hidden_size`` values)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    family = kind.removesuffix("-sharded")
    tok, ids, tok_cfg, gen = _family_files(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        _config(family, tok.get_vocab_size(), ids,
                                                      {**SHAPE, **(shape or {})})).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dst), max_shard_size="150KB" if kind.endswith("-sharded") else "1GB")
    GenerationConfig(**gen).save_pretrained(str(dst))  # type: ignore[no-untyped-call]  # untyped in transformers
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return dst


@lru_cache(maxsize=None)
def family_model(kind: str) -> Path:
    """The ``kind`` model folder, built once per process (do not modify it: copy it first)."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="intellect-families-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    return build_family_model(kind, _ROOT[0] / kind)


def copy_model(kind: str, dst: Path) -> Path:
    """A writable copy of the ``kind`` model folder at ``dst``."""
    shutil.copytree(family_model(kind), dst, dirs_exist_ok=True)
    return dst
