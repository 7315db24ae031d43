"""The trainer's own causal LM: the supported families as plain ``torch.nn`` modules, without transformers.

Why: importing transformers' model code and building a model through ``from_pretrained`` costs the
trainer about 2.4 s of one core at start (measured on this project's 2-core machine: the import 1.0 s,
the load 1.4 s, for the embedded 1M-parameter model), and a trainer's start is the swarm's critical path
to its first step. This module builds the same network from ``config.json`` and the safetensors in
about 0.01 s.

What it computes is what ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` compute, from the same :mod:`models.families` description the inference decoder
(``inference/decoder.py``) uses: RMSNorm in float32, rotary embeddings (rotate-half, the config's
scaling), grouped-query attention through SDPA, Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
sliding-window layers, SwiGLU, tied or untied embeddings. ``tests/trainer/test_lean_model.py`` holds it
to transformers' logits and gradients for every family; the rest of the trainer's tests run on it.

The module tree and parameter names are transformers' (``model.layers.N.self_attn.q_proj.weight``...),
so ``state_dict()`` is the checkpoint and policy format the swarm already publishes, FSDP2 shards
``model.model.layers`` as before, and a checkpoint written by either implementation loads into the other.
Parameters are created on the meta device and replaced by the loaded tensors, so no random init runs.

Shortcuts: no dropout (every supported family ships ``attention_dropout = 0``; a config with more is
refused, see :func:`check_supported`); ``position_ids`` only place tokens for RoPE (packed sequences
are not separated, the trainer never packs); no KV cache (training runs whole sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from intellect_node.errors import ConfigError
from intellect_node.models.families import Architecture, architecture, inv_frequencies
from intellect_node.models.ops import rms_norm, rotate

Device = str | torch.device

_IGNORED_KEYS = ("rotary_emb.inv_freq",)
"""Tensors some checkpoints carry that are derived, not learned (older transformers saved them)."""


class Linear(nn.Linear):
    """``nn.Linear`` without its random init: every weight is loaded (and initialising a "meta" tensor
    would import torch._dynamo, a second of start-up on this machine)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its random init (see :class:`Linear`)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: Device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: Architecture, device: Device) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.n_heads, self.n_kv, self.head_dim = arch.n_heads, arch.n_kv_heads, d
        self.q_proj = Linear(h, self.n_heads * d, bias=arch.qkv_bias, device=device)
        self.k_proj = Linear(h, self.n_kv * d, bias=arch.qkv_bias, device=device)
        self.v_proj = Linear(h, self.n_kv * d, bias=arch.qkv_bias, device=device)
        self.o_proj = Linear(self.n_heads * d, h, bias=arch.o_bias, device=device)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, device)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, device)
        self.qk_norm = arch.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_heads, d)
        k = self.k_proj(x).view(B, T, self.n_kv, d)
        v = self.v_proj(x).view(B, T, self.n_kv, d).transpose(1, 2)
        if self.qk_norm:  # Qwen3: RMSNorm over each head's dimensions, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv != self.n_heads)
        out: torch.Tensor = self.o_proj(a.transpose(1, 2).reshape(B, T, self.n_heads * d))
        return out


class MLP(nn.Module):
    def __init__(self, arch: Architecture, device: Device) -> None:
        super().__init__()
        h, inter = arch.hidden_size, arch.intermediate_size
        self.gate_proj = Linear(h, inter, bias=arch.mlp_bias, device=device)
        self.up_proj = Linear(h, inter, bias=arch.mlp_bias, device=device)
        self.down_proj = Linear(inter, h, bias=arch.mlp_bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: Architecture, sliding: bool, device: Device) -> None:
        super().__init__()  # registered in transformers' order: parameters() (and optimizer state) agree
        self.self_attn = Attention(arch, device)
        self.mlp = MLP(arch, device)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device)
        self.sliding = sliding

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full: torch.Tensor | None,
                window: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, window if self.sliding else full)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class DecoderStack(nn.Module):
    """``model.*`` of a transformers causal LM: embeddings, layers, final norm."""

    def __init__(self, arch: Architecture, pad_id: int | None, device: Device) -> None:
        super().__init__()
        # The pad token's row gets no gradient, as in transformers (``padding_idx = pad_token_id``).
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, padding_idx=pad_id, device=device)
        self.layers = nn.ModuleList(DecoderLayer(arch, arch.sliding_layers[i], device)
                                    for i in range(arch.n_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class LeanCausalLM(nn.Module):
    """A supported family's causal LM for training; ``model(input_ids=, attention_mask=, position_ids=)``
    returns an object with ``.logits`` [B, T, vocab], as transformers' models do."""

    inv_freq: torch.Tensor
    """RoPE's inverse frequencies [head_dim // 2]: a non-persistent buffer, set by :func:`build`."""

    def __init__(self, arch: Architecture, pad_id: int | None = None, device: Device = "meta") -> None:
        """Parameters on ``device``, uninitialised: on "meta" (the default) they are placeholders that
        :func:`build` replaces with the loaded tensors."""
        super().__init__()
        self.arch = arch
        self.model = DecoderStack(arch, pad_id, device)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False, device=device)
        if arch.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.empty(arch.head_dim // 2, device=device),
                             persistent=False)  # set by build
        self.is_gradient_checkpointing = False
        self._checkpoint_kwargs: dict[str, Any] = {}

    def gradient_checkpointing_enable(self,
                                      gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Recompute each decoder layer in the backward (only while training, as transformers does)."""
        self._checkpoint_kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        self.is_gradient_checkpointing = True

    def _masks(self, attention_mask: torch.Tensor | None, T: int,
               device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(full, window) boolean masks [B|1, 1, T, T] (True: may attend); full is None where plain
        causal attention is exact: no mask, or right padding (real tokens never see a later pad)."""
        slot = torch.arange(T, device=device)
        causal = slot.view(1, T) <= slot.view(T, 1)  # [q, k]
        right_padded = attention_mask is None or bool(
            (attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
        full = None
        allowed = causal.unsqueeze(0)
        if not right_padded:
            assert attention_mask is not None
            # Real keys only; a pad query sees itself, so no row is all masked (NaN rows poison gradients).
            allowed = (causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)) | torch.eye(
                T, dtype=torch.bool, device=device).unsqueeze(0)
            full = allowed.unsqueeze(1)
        window = None
        if self.arch.sliding_window is not None and any(self.arch.sliding_layers):
            band = (slot.view(T, 1) - slot.view(1, T)) < self.arch.sliding_window
            window = (allowed & band).unsqueeze(1)  # the diagonal stays: every row keeps its own slot
        return full, window

    def _given_masks(self, allowed: torch.Tensor,
                     position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(full, window) from a caller's ``allowed`` [B, T, T]; the sliding band is measured in
        positions, not slots (a packed row's slots are not its tokens' positions)."""
        window = None
        if self.arch.sliding_window is not None and any(self.arch.sliding_layers):
            band = (position_ids.unsqueeze(2) - position_ids.unsqueeze(1)) < self.arch.sliding_window
            window = (allowed & band).unsqueeze(1)
        return allowed.unsqueeze(1), window

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *,
                allowed: torch.Tensor | None = None) -> CausalLMOutput:
        """Logits [B, T, vocab]. ``allowed`` [B, T, T] (True: the query slot may attend the key slot),
        with ``position_ids``, replaces ``attention_mask`` for layouts that are not one sequence per
        row: the trainer's packed groups (``step.pack_groups``), where completions share one prompt.
        Every row of ``allowed`` must allow at least one slot (its own)."""
        B, T = input_ids.shape
        device = input_ids.device
        if allowed is not None and (position_ids is None or attention_mask is not None):
            raise ValueError("allowed needs position_ids and replaces attention_mask")
        if position_ids is None:
            position_ids = torch.arange(T, device=device).unsqueeze(0).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        inv = self.inv_freq
        with torch.autocast(device_type=device.type, enabled=False):  # angles in float32, as transformers
            freqs = position_ids[..., None].float() * inv.float()
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)  # [B, 1, T, d]
        if allowed is None:
            full, window = self._masks(attention_mask, T, device)
        else:
            full, window = self._given_masks(allowed, position_ids)
        recompute = self.is_gradient_checkpointing and self.training
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, full, window, **self._checkpoint_kwargs)
            else:
                x = layer(x, cos, sin, full, window)
        return CausalLMOutput(self.lm_head(self.model.norm(x)))


def check_supported(config: dict[str, Any], path: Path) -> Architecture:
    arch = architecture(config)
    dropout = config.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise ConfigError(f"{path}: attention_dropout = {dropout} is not supported by the trainer (RL "
                          "fine-tuning runs without dropout); set it to 0.0 in config.json", field="model")
    return arch


def build(config: dict[str, Any], state: dict[str, torch.Tensor], path: Path,
          device: str | torch.device = "cpu") -> LeanCausalLM:
    """The model of ``config`` holding the tensors ``state`` (by transformers' names, fp32) on ``device``;
    ConfigError naming any weight the folder lacks or has in another shape."""
    arch = check_supported(config, path)
    pad = config.get("pad_token_id")
    in_vocab = isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < arch.vocab_size
    pad_id = pad if in_vocab else None
    # Each constructor is told "meta" (a `with torch.device("meta")` block imports torch._dynamo).
    model = LeanCausalLM(arch, pad_id, "meta")
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_KEYS)}
    if arch.tied_embeddings:
        state.pop("lm_head.weight", None)  # tied: the head is the embedding, whatever the file holds
    expected = {k: v.shape for k, v in model.state_dict().items()
                if not (arch.tied_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(f"{path}: weights missing for {len(missing)} tensors of a {arch.model_type} model "
                          f"with this config.json, e.g. {', '.join(missing[:3])}", field="model")
    wrong = [f"{k} {tuple(state[k].shape)} (config says {tuple(s)})" for k, s in expected.items()
             if state[k].shape != s]
    if wrong:
        raise ConfigError(f"{path}: weights do not match config.json: {'; '.join(wrong[:3])}", field="model")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    if arch.tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_frequencies(arch)
    return model.to(device)


__all__ = ["CausalLMOutput", "LeanCausalLM", "build", "check_supported"]
