"""Model and tokenizer loading shared by the engines, the verifier and the trainer.

Models are Hugging Face folders (``config.json``, ``model.safetensors`` or shards named by
``model.safetensors.index.json``, ``tokenizer.json``) of the families in :mod:`models.families`;
docs/models.md says what a folder needs. The embedded model lives in ``intellect_node/assets/model``
and is built by ``scripts/make_model.py``. A ``--model`` that is not a folder but looks like a hub ID
(``org/name``) is taken from the Hugging Face cache, downloaded there first when the hub is reachable
and not switched off (``HF_HUB_OFFLINE=1``). A ``.gguf`` file is imported once into the user cache
(:mod:`models.gguf`) and that folder is used.

The dtype is part of a run's configuration: the worker generates and the validator prefills in the same
dtype, because TOPLOC and logprob thresholds are calibrated per dtype (fp32 on CPU is near bit-exact).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from intellect_node.errors import ConfigError
from intellect_node.models.families import SUPPORTED_MODEL_TYPES, Architecture, architecture
from intellect_node.models.tokenizer import ModelTokenizer

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, PreTrainedModel

__all__ = ["SUPPORTED_MODEL_TYPES", "LoadedModel", "ModelTokenizer", "embedded_model_dir", "export_model",
           "load_hf_model", "load_model", "load_tokenizer", "read_config", "read_weight_shapes",
           "read_weights", "resolve_model_dir", "torch_dtype"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
"""The character vocabulary after the four special tokens: newline and printable ASCII."""
VOCAB_SIZE = 128
"""Padded with ``<reserved_i>`` tokens to a round size so the embedding rows align."""

DTYPES = ("float32", "bfloat16", "float16")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "generation_config.json", "training.json")
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
"""What a hub download fetches: configs, tokenizer files, chat template and safetensors weights (not the
``.bin``/``.pth`` copies many repositories also hold)."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


EMBEDDED_ARCH: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
"""The embedded model's shape (1.02M parameters), after the arithmetic model measured in the notes."""


def embedded_config() -> LlamaConfig:
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


EMBEDDED_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                          "{{ message['content'] }}{% endif %}{% endfor %}")
"""The embedded model's chat template: ``<bos>`` and the user's text, nothing else (a system prompt is
ignored: the model was pretrained on bare arithmetic), so its prompts are the tokens it was trained on."""


def tokenizer_config_files() -> dict[str, str]:
    """``tokenizer_config.json`` (with the chat template) and ``special_tokens_map.json``."""
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,
           "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "padding_side": "left", **special, "chat_template": EMBEDDED_CHAT_TEMPLATE}
    return {"tokenizer_config.json": json.dumps(cfg, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def embedded_model_dir() -> Path:
    """The folder of the embedded model inside the installed package."""
    path = Path(str(resources.files("intellect_node") / "assets" / "model"))
    if not (path / "config.json").exists():
        raise ConfigError(f"the embedded model is missing from {path}; run `python scripts/make_model.py`",
                          field="model")
    return path


def resolve_model_dir(model: str | Path | None) -> Path:
    """``--model DIR`` (or a hub ID, or a ``.gguf`` file) or the embedded model; ConfigError naming the
    flag when it is not a model folder."""
    if model is None:
        return embedded_model_dir()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        from intellect_node.models.gguf import imported_dir

        return imported_dir(path)  # imported once into the user cache (docs/models.md, "GGUF files")
    if not path.exists() and _HUB_ID.match(str(model)):
        path = _from_hub(str(model))
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).exists()]
    if not (path / WEIGHTS).exists() and not (path / WEIGHTS_INDEX).exists():
        missing.append(WEIGHTS)
    if missing:
        raise ConfigError(f"--model {path} is not a model folder (missing {', '.join(missing)}); "
                          "pass a folder written by `intellect-node model export`, a Hugging Face "
                          "model folder or a .gguf file", field="model")
    return path


def _from_hub(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id``: from the local cache first, downloaded when allowed."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache_dir = os.environ.get("HF_HUB_CACHE") or None  # read now: the library reads it at import
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True,
                                      cache_dir=cache_dir))
    except LocalEntryNotFoundError:
        pass
    fix = (f"download it first (`hf download {repo_id}` where the hub is reachable, or copy it into the "
           "Hugging Face cache) or pass a model folder")
    if offline:
        raise ConfigError(f"--model {repo_id}: not a folder, and not in the Hugging Face cache while "
                          f"offline (HF_HUB_OFFLINE); {fix}", field="model")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, cache_dir=cache_dir))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ConfigError(f"--model {repo_id}: not a folder, and the Hugging Face hub did not provide it "
                          f"({type(exc).__name__}: {exc}); {fix}", field="model") from exc


def export_model(dst: str | Path, src: Path | None = None) -> Path:
    """Copy the model folder ``src`` (default: embedded) to ``dst``; refuses to overwrite other files."""
    src = src or embedded_model_dir()
    dst = Path(dst).expanduser()
    if dst.exists() and any(dst.iterdir()) and not (dst / "config.json").exists():
        raise ConfigError(f"{dst} exists and is not an empty or model folder; pick another DIR", field="dir")
    dst.mkdir(parents=True, exist_ok=True)
    names = list(MODEL_FILES) + ["proof_thresholds.json", "chat_template.jinja", WEIGHTS_INDEX]
    names += sorted(_weight_files(src)[1])
    for name in dict.fromkeys(names):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}", field="dtype")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


@dataclass(frozen=True)
class LoadedModel:
    """A model folder loaded for inference: config dict, tensors by HF name, tokenizer, dtype."""

    path: Path
    config: dict[str, Any]
    state: dict[str, "torch.Tensor"]
    tokenizer: ModelTokenizer
    dtype: str

    @property
    def arch(self) -> Architecture:
        return architecture(self.config)


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` of a model folder, its family checked (ConfigError naming the model_type)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {path}: config.json is not readable JSON ({exc})", field="model") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"--model {path}: config.json does not hold an object", field="model")
    try:
        architecture(config)
    except ConfigError as exc:
        raise ConfigError(f"--model {path}: {exc.args[0]}", field="model") from exc
    return config


def _weight_files(path: Path) -> tuple[dict[str, str] | None, set[str]]:
    """(tensor name -> shard file, or None for a single file; the files to read)."""
    index = path / WEIGHTS_INDEX
    if (path / WEIGHTS).exists() or not index.exists():
        return None, {WEIGHTS}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--model {path}: {WEIGHTS_INDEX} has no readable weight_map ({exc})",
                          field="model") from exc
    files = set(weight_map.values())
    if not all(isinstance(f, str) and "/" not in f and f.endswith(".safetensors") for f in files):
        raise ConfigError(f"--model {path}: {WEIGHTS_INDEX} names files outside the folder", field="model")
    return weight_map, files


def load_tokenizer(model: str | Path | None = None) -> ModelTokenizer:
    """The tokenizer of a model folder (default: the embedded model)."""
    return ModelTokenizer(resolve_model_dir(model))


def load_model(model: str | Path | None = None, dtype: str = "float32", device: str = "cpu", *,
               weights: bool = True) -> LoadedModel:
    """A supported model folder's weights as plain tensors (no transformers import).

    Tensors are read one at a time from the safetensors file(s) and converted to ``dtype`` on ``device``
    as they arrive, so at most one tensor exists twice: a model that fits once fits while loading.

    ``weights=False``: the tensors are meta tensors (names, shapes and ``dtype``; no data, only the files'
    headers read), for a role whose weights come from a policy checkpoint: it needs the config, the
    tokenizer and what a checkpoint must hold, not a second copy of the model in memory."""
    path = resolve_model_dir(model)
    config = read_config(path)
    state = read_weights(path, dtype, device) if weights else read_weight_shapes(path, dtype)
    return LoadedModel(path=path, config=config, state=state, tokenizer=ModelTokenizer(path), dtype=dtype)


def _each_tensor(path: Path, device: str = "cpu") -> Iterator[tuple[str, Any]]:
    """(name, open safetensors file) for every tensor of the folder's weights file(s), each from the file
    the index names for it."""
    from safetensors import safe_open

    weight_map, files = _weight_files(path)
    for name in sorted(files):
        if not (path / name).exists():
            raise ConfigError(f"--model {path}: weights file {name} is missing", field="model")
        with safe_open(str(path / name), framework="pt", device=device) as f:
            for key in f.keys():
                if weight_map is None or weight_map.get(key) == name:
                    yield key, f


def read_weight_shapes(path: Path, dtype: str = "float32") -> dict[str, "torch.Tensor"]:
    """Every tensor of the folder's safetensors file(s) by name as a meta tensor of its shape in
    ``dtype``: the files' headers are read, never their data."""
    import torch

    td = torch_dtype(dtype)
    return {key: torch.empty(f.get_slice(key).get_shape(), dtype=td, device="meta")
            for key, f in _each_tensor(path)}


def read_weights(path: Path, dtype: str = "float32", device: str = "cpu") -> dict[str, "torch.Tensor"]:
    """Every tensor of the folder's safetensors file(s) by name, in ``dtype`` on ``device``, read one at a
    time (at most one tensor exists twice while loading)."""
    td = torch_dtype(dtype)
    # safetensors places tensors on a CUDA device itself; CPU tensors are copied out of the mmap.
    where = device if device.startswith("cuda") else "cpu"
    return {key: f.get_tensor(key).to(device=device, dtype=td) for key, f in _each_tensor(path, where)}


def load_hf_model(model: str | Path | None = None, dtype: str = "float32") -> "PreTrainedModel":
    """The folder as a transformers causal LM (``AutoModelForCausalLM``; training and the reference)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_dir(model)
    read_config(path)
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
    m.eval()  # type: ignore[no-untyped-call]  # transformers' nn.Module.eval is untyped
    return m
