"""A trained policy out as a Hugging Face model folder that transformers and vLLM load offline.

``export_folder(base, weights, out, dtype=)`` writes ``out`` from the run's model folder ``base`` (its
config and tokenizer) and a policy version's tensors (``weights``, by transformers' names: the trainer's
network uses them, ``trainer/lean.py``):

- ``config.json``: the base's, its dtype field set to ``dtype``;
- ``model.safetensors``: every tensor of the base's weights file(s), from ``weights``, converted to
  ``dtype`` (a tied output head is left out, as transformers saves it);
- the tokenizer files the base has (``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
  ``special_tokens_map.json``, ``chat_template.jinja``, ...), copied as they are;
- ``generation_config.json``: the base's, or one naming the config's BOS, EOS and pad IDs;
- ``policy.json``: where the weights came from (run, version, policy hash), what ``provenance`` says.

The folder is filled under a temporary name beside ``out`` and renamed into place, so a reader never
sees half a folder. ``models.gguf_export`` turns such a folder into a GGUF file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from intellect_node.errors import ConfigError
from intellect_node.fsutil import fsync_dir
from intellect_node.models.families import architecture
from intellect_node.models.loader import DTYPES, read_config, read_weight_shapes, torch_dtype

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
"""The base folder's files copied as they are (those it has)."""
PROVENANCE_FILE = "policy.json"


def folder_dtype(config: Mapping[str, object]) -> str:
    """The dtype a folder's config names (``dtype``, or ``torch_dtype`` before transformers 5), float32
    when it names none of :data:`models.loader.DTYPES`."""
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) and value in DTYPES else "float32"


def _check_weights(base: Path, weights: Mapping[str, "torch.Tensor"], tied: bool) -> list[str]:
    """The tensor names to write: every tensor of the base's files; ConfigError when ``weights`` lacks
    one or holds it in another shape (a policy of another model)."""
    shapes = read_weight_shapes(base)
    names = sorted(k for k in shapes if not (tied and k == "lm_head.weight"))
    missing = [k for k in names if k not in weights]
    if missing:
        raise ConfigError(f"--model {base}: the policy lacks {len(missing)} of the model's tensors, e.g. "
                          f"{', '.join(missing[:3])}; is it a policy of this model?", field="model")
    wrong = [f"{k} {tuple(weights[k].shape)} (the model's {tuple(shapes[k].shape)})" for k in names
             if tuple(weights[k].shape) != tuple(shapes[k].shape)]
    if wrong:
        raise ConfigError(f"--model {base}: the policy's tensors do not fit the model: "
                          f"{'; '.join(wrong[:3])}", field="model")
    return names


def _generation_config(base: Path, config: Mapping[str, object]) -> str:
    if (base / "generation_config.json").is_file():
        return (base / "generation_config.json").read_text(encoding="utf-8")
    doc = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config.get(k) is not None}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def export_folder(base: str | Path, weights: Mapping[str, "torch.Tensor"], out: str | Path, *,
                  dtype: str | None = None, provenance: Mapping[str, object] | None = None) -> Path:
    """Write the Hugging Face folder of ``weights`` on the model folder ``base`` to ``out`` (a new or empty
    folder) in ``dtype`` (default: the base's); returns ``out``."""
    from safetensors.torch import save_file

    base = Path(base)
    config = read_config(base)
    dtype = dtype or folder_dtype(config)
    td = torch_dtype(dtype)  # ConfigError naming dtype when it is not one of DTYPES
    names = _check_weights(base, weights, architecture(config).tied_embeddings)
    dst = Path(out).expanduser().absolute()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(f"--out {dst} exists and is not an empty folder; pick another", field="out")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".exporting", dir=dst.parent))
    try:
        cfg = dict(config)
        cfg["dtype" if "dtype" in cfg else "torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tensors = {k: weights[k].detach().to("cpu", dtype=td).contiguous() for k in names}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        for name in TOKENIZER_FILES:
            if (base / name).is_file():
                shutil.copyfile(base / name, tmp / name)
        (tmp / "generation_config.json").write_text(_generation_config(base, config), encoding="utf-8")
        where = json.dumps(dict(provenance or {}), indent=2, sort_keys=True) + "\n"
        (tmp / PROVENANCE_FILE).write_text(where, encoding="utf-8")
        for p in tmp.iterdir():
            with p.open("rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        fsync_dir(tmp)
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dst.parent)
    return dst
