"""How much memory a role needs for a model, before it loads one (``doctor --model``, the start check).

Out-of-memory kills are the first complaint of operators of comparable swarms, and they come minutes
into a run (after the download, at the first long batch). The estimate is made from the model's
``config.json`` and safetensors headers only, so it is instant for a multi-GB model:

* weights: parameter count (exact, from the safetensors headers when the weights are there; otherwise
  from the config's shapes for the decoder families) times the bytes of the run's dtype;
* KV cache: ``2 (K and V) * layers * kv_heads * head_dim * tokens * batch * dtype bytes``;
* training state: weights + gradients in the dtype, AdamW's two moments in float32, and a float32 master
  copy when the dtype is not float32 (bf16 training keeps fp32 masters).

Shortcuts, so the figures are lower bounds: activations are counted only where they dominate (the
verifier's prefill logits, the trainer's logits for one micro-batch); allocator fragmentation, CUDA
context (~0.5 GiB) and Python's own memory are not. Each role's sum says which parts it holds
(:func:`role_estimate`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


def fmt_bytes(n: float) -> str:
    """2.41 GiB, 37.5 MiB: what an operator compares with `free -h` and `nvidia-smi`."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder that memory depends on."""

    n_params: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    exact: bool
    """Whether ``n_params`` was counted from the weights' headers (else from the config's shapes)."""


def _head_dim(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def params_from_config(cfg: Mapping[str, Any]) -> int:
    """Parameters of a Llama/Mistral/Qwen2/Qwen3 decoder from its config (the families' tensor shapes)."""
    h, v, i = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["intermediate_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = _head_dim(cfg)
    kind = cfg.get("model_type", "llama")
    qkv_bias = kind == "qwen2" or bool(cfg.get("attention_bias"))
    o_bias = kind != "qwen2" and bool(cfg.get("attention_bias"))
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    attn += (nh * hd + 2 * nkv * hd if qkv_bias else 0) + (h if o_bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if cfg.get("mlp_bias") else 0)
    norms = 2 * h + (2 * hd if kind == "qwen3" else 0)
    tied = bool(cfg.get("tie_word_embeddings", False))
    return int(cfg["num_hidden_layers"]) * (attn + mlp + norms) + h + v * h * (1 if tied else 2)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    return [single] if single.exists() else []


def params_from_weights(path: Path) -> int | None:
    """Elements of every tensor in the folder's safetensors files (headers only); None without weights."""
    files = _safetensors_files(path)
    if not files or not all(f.exists() for f in files):
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total += count
    return total


def model_shape(path: Path) -> Shape:
    """The shape of the model folder at ``path`` (config.json, and the weights' headers when present)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    counted = params_from_weights(path)
    n = counted if counted is not None else params_from_config(cfg)
    nh = int(cfg["num_attention_heads"])
    return Shape(n_params=n, n_layers=int(cfg["num_hidden_layers"]),
                 n_kv_heads=int(cfg.get("num_key_value_heads") or nh), head_dim=_head_dim(cfg),
                 hidden_size=int(cfg["hidden_size"]), vocab_size=int(cfg["vocab_size"]),
                 exact=counted is not None)


def weight_bytes(shape: Shape, dtype: str) -> int:
    return shape.n_params * DTYPE_BYTES[dtype]


def kv_cache_bytes(shape: Shape, dtype: str, *, tokens: int, batch: int) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``tokens`` positions."""
    return 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * tokens * batch * DTYPE_BYTES[dtype]


def training_bytes(shape: Shape, dtype: str) -> int:
    """Weights + gradients (dtype), AdamW's two moments (float32), a float32 master unless float32."""
    master = 0 if dtype == "float32" else 4 * shape.n_params
    return 2 * weight_bytes(shape, dtype) + 8 * shape.n_params + master


@dataclass(frozen=True)
class Estimate:
    """A role's memory need, part by part (bytes), and the settings it was computed for."""

    role: str
    parts: dict[str, int]
    settings: dict[str, str | int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.parts.items())


def role_estimate(shape: Shape, role: str, dtype: str, *, batch: int, tokens: int, engine: str = "torch",
                  versions: int = 3) -> Estimate:
    """What ``role`` holds at its peak. worker: the base model and the current policy (one copy under
    vLLM, which swaps weights in place) and the KV cache of one batch. validator: ``versions`` policy
    versions (``async_level + 1``) and the base, and one prefill's logits and hidden states (float32).
    trainer: the training state, a published copy of the policy, and one micro-batch's float32 logits
    (``batch`` sequences)."""
    w = weight_bytes(shape, dtype)
    settings: dict[str, str | int] = {"dtype": dtype, "batch": batch, "tokens": tokens, "engine": engine}
    if role == "worker":
        copies = 1 if engine == "vllm" else 2
        parts = {f"weights x{copies}": copies * w,
                 "KV cache": kv_cache_bytes(shape, dtype, tokens=tokens, batch=batch)}
    elif role == "validator":
        act = batch * tokens * (shape.vocab_size + shape.hidden_size) * 4
        parts = {f"weights x{versions + 1}": (versions + 1) * w, "prefill logits and hidden": act}
        settings["versions"] = versions
    elif role == "trainer":
        parts = {"training state": training_bytes(shape, dtype), "published policy": w,
                 "logits (one micro-batch)": batch * tokens * shape.vocab_size * 4}
    else:
        raise ValueError(f"role {role!r} is not worker, validator or trainer")
    return Estimate(role=role, parts=parts, settings=settings)


def available_bytes(device: str) -> tuple[int, str]:
    """Free memory where the role's tensors go, and what was measured: the GPU's free memory
    (``torch.cuda.mem_get_info``) for a CUDA device, else this machine's available RAM."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"{device} free ({total / GIB:.1f} GiB total)"
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), f"RAM available ({vm.total / GIB:.1f} GiB total)"
