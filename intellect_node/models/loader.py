"""Model and tokenizer loading shared by the engines, the verifier and the trainer.

Models are Hugging Face folders (``config.json``, ``model.safetensors``, ``tokenizer.json``). The embedded
model lives in ``intellect_node/assets/model`` and is built by ``scripts/make_model.py``. Everything loads
offline from a local folder; nothing is fetched from a hub.

The dtype is part of a run's configuration: the worker generates and the validator prefills in the same
dtype, because TOPLOC and logprob thresholds are calibrated per dtype (fp32 on CPU is near bit-exact).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
"""The character vocabulary after the four special tokens: newline and printable ASCII."""
VOCAB_SIZE = 128
"""Padded with ``<reserved_i>`` tokens to a round size so the embedding rows align."""

DTYPES = ("float32", "bfloat16", "float16")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "generation_config.json", "training.json")


EMBEDDED_ARCH: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
"""The embedded model's shape (1.02M parameters), after the arithmetic model measured in the notes."""


def embedded_config() -> Any:
    """A transformers ``LlamaConfig`` for the embedded architecture and the char tokenizer's IDs."""
    from transformers import LlamaConfig

    vocab = char_vocab()
    return LlamaConfig(vocab_size=VOCAB_SIZE, tie_word_embeddings=False, bos_token_id=vocab[BOS],
                       eos_token_id=vocab[EOS], pad_token_id=vocab[PAD], attention_bias=False, mlp_bias=False,
                       hidden_act="silu", **EMBEDDED_ARCH)


def write_tokenizer_files(dst: Path) -> None:
    (dst / "tokenizer.json").write_text(build_char_tokenizer_json())
    for name, text in tokenizer_config_files().items():
        (dst / name).write_text(text)


def char_vocab() -> dict[str, int]:
    tokens = list(SPECIALS) + list(CHARS)
    tokens += [f"<reserved_{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    return {t: i for i, t in enumerate(tokens)}


def build_char_tokenizer_json() -> str:
    """The ``tokenizer.json`` of the char-level tokenizer: one token per character, Fuse decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character into its own piece; `[\s\S]` so newline is a piece too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok.to_str()


def tokenizer_config_files() -> dict[str, str]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for transformers' AutoTokenizer."""
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,
           "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "padding_side": "left", **special}
    return {"tokenizer_config.json": json.dumps(cfg, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


class CharTokenizer:
    """Encode/decode for the project's models (fast path over ``tokenizers``; no transformers import)."""

    def __init__(self, tokenizer_json: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))
        vocab = self._tok.get_vocab()
        try:
            self.pad_id, self.bos_id, self.eos_id = vocab[PAD], vocab[BOS], vocab[EOS]
        except KeyError as exc:
            raise ConfigError(f"{tokenizer_json} lacks the special token {exc}", field="model") from exc
        self.vocab_size = len(vocab)
        self.special_ids = {vocab[s] for s in SPECIALS if s in vocab}

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token IDs a rollout starts from: ``<bos>`` then the prompt's characters."""
        return [self.bos_id, *self.encode(prompt)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` up to (not including) the first ``<eos>``; other specials dropped."""
        out: list[int] = []
        for i in ids:
            if i == self.eos_id:
                break
            if i not in self.special_ids:
                out.append(i)
        return str(self._tok.decode(out, skip_special_tokens=True))


def embedded_model_dir() -> Path:
    """The folder of the embedded model inside the installed package."""
    path = Path(str(resources.files("intellect_node") / "assets" / "model"))
    if not (path / "config.json").exists():
        raise ConfigError(f"the embedded model is missing from {path}; run `python scripts/make_model.py`",
                          field="model")
    return path


def resolve_model_dir(model: str | Path | None) -> Path:
    """``--model DIR`` or the embedded model; ConfigError naming the flag when DIR is not a model."""
    if model is None:
        return embedded_model_dir()
    path = Path(model).expanduser()
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).exists()]
    if missing:
        raise ConfigError(f"--model {path} is not a model folder (missing {', '.join(missing)}); "
                          "pass a folder written by `intellect-node model export`", field="model")
    return path


def export_model(dst: str | Path, src: Path | None = None) -> Path:
    """Copy the model folder ``src`` (default: embedded) to ``dst``; refuses to overwrite other files."""
    src = src or embedded_model_dir()
    dst = Path(dst).expanduser()
    if dst.exists() and any(dst.iterdir()) and not (dst / "config.json").exists():
        raise ConfigError(f"{dst} exists and is not an empty or model folder; pick another DIR", field="dir")
    dst.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES + ("proof_thresholds.json",):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}", field="dtype")
    return getattr(torch, name)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class LoadedModel:
    """A model folder loaded for inference: config dict, tensors by HF name, tokenizer, dtype."""

    path: Path
    config: dict[str, Any]
    state: dict[str, "torch.Tensor"]
    tokenizer: CharTokenizer
    dtype: str


def load_model(model: str | Path | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a Llama-architecture folder's weights as plain tensors (no transformers import)."""
    from safetensors.torch import load_file

    path = resolve_model_dir(model)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(f"{path}: model_type {config.get('model_type')!r} is not supported (llama only)",
                          field="model")
    td = torch_dtype(dtype)
    state = {k: v.to(device=device, dtype=td) for k, v in load_file(str(path / "model.safetensors")).items()}
    return LoadedModel(path=path, config=config, state=state,
                       tokenizer=CharTokenizer(path / "tokenizer.json"), dtype=dtype)


def load_hf_model(model: str | Path | None = None, dtype: str = "float32") -> "LlamaForCausalLM":
    """The folder as a transformers ``LlamaForCausalLM`` (for training and as a baseline)."""
    from transformers import LlamaForCausalLM

    path = resolve_model_dir(model)
    m = LlamaForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
    m.eval()
    return m
