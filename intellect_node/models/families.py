"""The decoder families the torch runner implements, read from a Hugging Face ``config.json``.

Llama, Mistral, Qwen2 and Qwen3 are one architecture (pre-norm decoder, RMSNorm, rotary embeddings in
the rotate-half layout, grouped-query attention, SwiGLU MLP) with small differences, each a field of
:class:`Architecture`:

* Qwen2 always has biases on the q/k/v projections; Llama and Qwen3 have them (and on o_proj) when
  ``attention_bias`` is set; Llama's MLP has them when ``mlp_bias`` is set; Mistral has none.
* Qwen3 normalises queries and keys per head (RMSNorm over ``head_dim``) before RoPE.
* Mistral attends within a sliding window on every layer when ``sliding_window`` is set; Qwen2/Qwen3 slide
  on the layers ``layer_types`` names (older configs: ``use_sliding_window`` from ``max_window_layers`` on).
* RoPE: plain, ``linear`` or Llama-3's ``llama3`` frequency scaling, from ``rope_scaling`` or transformers
  5's ``rope_parameters``. Other scalings (yarn, dynamic, longrope) are refused: their attention factor or
  position-dependent frequencies would need code the reference tests do not cover.

Anything else a config asks for that the runner does not implement (another activation, partial rotary
dimensions) is refused here with a :class:`ConfigError`, so a model is never run approximately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type`` values of ``config.json`` that :func:`architecture` (and so the torch runner) accepts."""

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Architecture:
    """What the runner needs to know of a model beyond its tensors."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    rope: dict[str, Any]
    """Normalised RoPE settings: ``rope_type``, ``rope_theta`` and the scaling's own keys."""
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]
    """Per layer: whether it attends within ``sliding_window`` only."""

    @property
    def n_params_estimate(self) -> int:
        """Parameters of the weight matrices (embedding, attention, MLP, head), for sizing decisions."""
        inter = self.intermediate_size
        attn = self.hidden_size * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * self.hidden_size * inter
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + head + self.n_layers * per_layer


def _int(cfg: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: {key} must be a positive integer, not {value!r}", field="model")
    return value


def rope_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either transformers 4's ``rope_theta`` + ``rope_scaling`` or 5's
    ``rope_parameters`` (which nests the theta too); the scaling type under ``rope_type`` (older configs
    say ``type``)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    theta = merged.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"RoPE scaling {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})",
                          field="model")
    if float(cfg.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ConfigError("partial rotary embeddings (partial_rotary_factor != 1) are not supported",
                          field="model")
    out = {"rope_type": rope_type, "rope_theta": float(theta)}
    if rope_type == "linear":
        out["factor"] = float(merged["factor"])
    elif rope_type == "llama3":
        try:
            out.update(factor=float(merged["factor"]), low_freq_factor=float(merged["low_freq_factor"]),
                       high_freq_factor=float(merged["high_freq_factor"]),
                       original_max_position_embeddings=int(merged["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"llama3 RoPE scaling lacks or mangles {exc}", field="model") from exc
    return out


def _sliding(cfg: dict[str, Any], model_type: str, n_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        layers = tuple(window is not None for _ in range(n_layers))
    elif model_type in ("qwen2", "qwen3"):
        types = cfg.get("layer_types")
        if types is None:  # configs written before transformers 5 name the sliding layers this way
            use = bool(cfg.get("use_sliding_window")) and window is not None
            first = int(cfg.get("max_window_layers") or 0)
            layers = tuple(use and i >= first for i in range(n_layers))
        else:
            if len(types) != n_layers or not set(types) <= {"full_attention", "sliding_attention"}:
                raise ConfigError(f"config.json: layer_types {types!r} do not fit {n_layers} layers",
                                  field="model")
            layers = tuple(t == "sliding_attention" for t in types)
    else:
        layers = tuple(False for _ in range(n_layers))
    if any(layers):
        return _int(cfg, "sliding_window"), layers
    return None, layers


def architecture(cfg: dict[str, Any]) -> Architecture:
    """The :class:`Architecture` of a ``config.json``; ConfigError for an unsupported family or feature."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported model types: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}", field="model")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {act!r} is not supported (silu only)", field="model")
    hidden = _int(cfg, "hidden_size")
    n_heads = _int(cfg, "num_attention_heads")
    n_kv = _int(cfg, "num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise ConfigError(f"{n_heads} attention heads do not share {n_kv} key/value heads evenly",
                          field="model")
    n_layers = _int(cfg, "num_hidden_layers")
    head_dim = cfg.get("head_dim") or hidden // n_heads
    bias = bool(cfg.get("attention_bias", False))
    window, sliding = _sliding(cfg, model_type, n_layers)
    return Architecture(
        model_type=model_type, hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=int(head_dim), vocab_size=_int(cfg, "vocab_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_positions=_int(cfg, "max_position_embeddings", 2048),
        qkv_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and bias),
        o_bias=model_type in ("llama", "qwen3") and bias,
        mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=rope_settings(cfg), sliding_window=window, sliding_layers=sliding,
        intermediate_size=_int(cfg, "intermediate_size"))


def inv_frequencies(arch: Architecture) -> "torch.Tensor":
    """RoPE inverse frequencies [head_dim / 2] (float32), after the scaling the config names. Computed in
    float32 with the same operations as transformers, so the angles agree to the last bit.

    ``llama3`` (Llama 3.1): wavelengths longer than ``original / low_freq_factor`` are slowed by
    ``factor``, those shorter than ``original / high_freq_factor`` are kept, and the band between is
    interpolated linearly in ``original / wavelength``."""
    import torch

    d, rope = arch.head_dim, arch.rope
    theta: float = rope["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    if rope["rope_type"] == "linear":
        return inv / float(rope["factor"])
    if rope["rope_type"] != "llama3":
        return inv
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    slowed = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    between = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, between, slowed)
