"""A lean decoder forward pass over plain tensors, shared by the torch engine and the verifier's prefill.

It computes what transformers' ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` compute (RMSNorm, rotary embeddings in the rotate-half layout, grouped-query attention,
SwiGLU MLP, and each family's differences from :mod:`models.families`: q/k/v biases, per-head q/k norms,
sliding windows, Llama-3 RoPE scaling) without module overhead, because on small models the per-step
Python cost, not the arithmetic, bounds decoding. Generation and verification run the same code, so an
honest rollout's hidden states agree closely (fp32: near bit-exact) between worker and validator.

Small models get their q/k/v and gate/up projections fused into one matrix each (one matmul instead of
three or two); that costs a second copy of those weights, so models above :data:`FUSE_MAX_PARAMS` keep
them apart and use the loaded tensors as they are.

Batches are left-padded: row ``r`` has ``pad[r]`` pad slots, its positions start at 0 after them, and a
boolean mask hides pad slots as keys. Pad slots attend to themselves only, so no row is fully masked
(which would give NaN rows that poison the attention of others via 0 * NaN). Slot distances equal
position distances for real tokens, so a sliding window is a band on slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from intellect_node.errors import ConfigError
from intellect_node.models.families import inv_frequencies
from intellect_node.models.loader import LoadedModel
from intellect_node.models.ops import rms_norm, rotate

FUSE_MAX_PARAMS = 200_000_000
"""Fuse projections below this many parameters: the fused copies then cost at most ~0.8 GB in fp32,
while above it the matmuls are large enough that fusing saves little (it saves Python per-op cost)."""


@dataclass
class KVCache:
    """Static cache: ``k``/``v`` of shape [layers, B, kv_heads, max_len, head_dim]; ``length`` filled."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor
    qkv: list[torch.Tensor]           # one fused matrix, or q, k, v
    qkv_bias: list[torch.Tensor] | None
    qk_norm: torch.Tensor | None      # [nq + nkv, head_dim]: q_norm repeated per query head, then k_norm
    wo: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: list[torch.Tensor]       # one fused matrix, or gate, up
    gate_up_bias: list[torch.Tensor] | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    sliding: bool
    fused: bool                       # qkv and gate_up hold one matrix each (the hot path checks this)


NARROW_ROWS = (8, 32)
"""Row counts for which :func:`linear` multiplies as ``(w @ x^T)^T``: at 8-32 rows (a batch's decoding
step) MKL's fp32 kernel for a narrow right-hand side ran the real model's shapes 1.5-2x faster than its
``x @ w^T`` (one thread; 1-4 rows and 64 or more were the same or slower). bench/README.md,
"Real-model speed (SmolLM2-135M)"."""


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``; on CPU in float32 with :data:`NARROW_ROWS` rows, as ``(w @ x^T)^T``. The
    result is the same product summed in another order, so it agrees to rounding (as any change of
    batch shape does), not bit for bit."""
    rows = x.numel() // x.shape[-1]
    if not (NARROW_ROWS[0] <= rows <= NARROW_ROWS[1] and x.dtype == torch.float32 and x.device.type == "cpu"):
        return F.linear(x, w, b)
    xt = x.reshape(rows, x.shape[-1]).t()
    y = torch.mm(w, xt) if b is None else torch.addmm(b.view(-1, 1), w, xt)
    return y.t().contiguous().view(*x.shape[:-1], w.shape[0])


def _project(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor] | None) -> torch.Tensor:
    if len(ws) == 1:
        return linear(x, ws[0], None if bs is None else bs[0])
    return torch.cat([linear(x, w, None if bs is None else b) for w, b in zip(ws, bs or ws)], dim=-1)


class DecoderRunner:
    def __init__(self, loaded: LoadedModel, device: str | torch.device = "cpu") -> None:
        arch = loaded.arch
        st = loaded.state
        self.arch = arch
        self.config = loaded.config
        self.device = torch.device(device)
        self.dtype = next(iter(st.values())).dtype
        self.hidden_size = arch.hidden_size
        self.n_layers, self.n_heads, self.n_kv, self.head_dim = (arch.n_layers, arch.n_heads, arch.n_kv_heads,
                                                                 arch.head_dim)
        self.eps = arch.rms_norm_eps
        self.max_positions = arch.max_positions
        self.vocab_size = arch.vocab_size
        self.window = arch.sliding_window

        def w(name: str) -> torch.Tensor:
            try:
                return st[name].to(self.device)
            except KeyError:
                raise ConfigError(f"{loaded.path}: weight {name} missing", field="model") from None

        self.embed = w("model.embed_tokens.weight")
        if "lm_head.weight" in st:
            self.lm_head = w("lm_head.weight")
        elif arch.tied_embeddings:
            self.lm_head = self.embed
        else:
            raise ConfigError(f"{loaded.path}: weight lm_head.weight missing (embeddings are not tied)",
                              field="model")
        self.final_norm = w("model.norm.weight")
        fuse = arch.n_params_estimate <= FUSE_MAX_PARAMS
        nq, nkv, d = self.n_heads, self.n_kv, self.head_dim

        def group(names: list[str], bias: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
            ws = [w(n + ".weight") for n in names]
            bs = [w(n + ".bias") for n in names] if bias else None
            if fuse and len(ws) > 1:
                return [torch.cat(ws)], None if bs is None else [torch.cat(bs)]
            return ws, bs

        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            qkv, qkv_b = group([p + f"self_attn.{n}_proj" for n in "qkv"], arch.qkv_bias)
            gu, gu_b = group([p + "mlp.gate_proj", p + "mlp.up_proj"], arch.mlp_bias)
            qk_norm = None
            if arch.qk_norm:
                qk_norm = torch.cat([w(p + "self_attn.q_norm.weight").expand(nq, d),
                                     w(p + "self_attn.k_norm.weight").expand(nkv, d)])
            self.layers.append(_Layer(
                ln1=w(p + "input_layernorm.weight"), qkv=qkv, qkv_bias=qkv_b, qk_norm=qk_norm,
                wo=w(p + "self_attn.o_proj.weight"),
                o_bias=w(p + "self_attn.o_proj.bias") if arch.o_bias else None,
                ln2=w(p + "post_attention_layernorm.weight"), gate_up=gu, gate_up_bias=gu_b,
                down=w(p + "mlp.down_proj.weight"),
                down_bias=w(p + "mlp.down_proj.bias") if arch.mlp_bias else None,
                sliding=arch.sliding_layers[i], fused=fuse))
        self.inv_freq = inv_frequencies(arch).to(self.device)
        self.cos = self.sin = torch.empty(0, d, device=self.device, dtype=self.dtype)
        self._rope_tables(min(self.max_positions, 256))

    def _rope_tables(self, n: int) -> None:
        """cos/sin tables for positions [0, n) (float32 angles, then the model dtype, as transformers)."""
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=self.device), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (self.n_layers, batch, self.n_kv, max_len, self.head_dim)
        return KVCache(torch.zeros(shape, device=self.device, dtype=self.dtype),
                       torch.zeros(shape, device=self.device, dtype=self.dtype))

    def _masks(self, key_valid: torch.Tensor, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Additive masks [B, 1, T, S] for full attention and (when a layer slides) the sliding window."""
        S = start + T
        q_slot = torch.arange(start, S, device=self.device).view(T, 1)
        k_slot = torch.arange(S, device=self.device).view(1, S)
        # Causal over slots, real keys only; pad queries see themselves (see module docstring).
        causal = (k_slot <= q_slot).unsqueeze(0) & key_valid[:, :S].unsqueeze(1)   # [B, T, S]
        own = (k_slot == q_slot).unsqueeze(0)

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            # One additive mask per call, shared by every layer (SDPA would convert a boolean one per layer).
            return torch.zeros(allowed.shape, device=self.device, dtype=self.dtype).masked_fill_(
                ~allowed, float("-inf")).unsqueeze(1)

        full = additive(causal | own)
        if self.window is None:
            return full, None
        return full, additive((causal & (q_slot - k_slot < self.window).unsqueeze(0)) | own)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] for tokens ``ids`` [B, T] at ``positions`` [B, T].

        ``key_valid`` [B, S] marks real (non-pad) slots among all S = cache.length + T keys. With a cache,
        the new keys/values are written at slots cache.length..cache.length+T-1 and the length advances.
        """
        B, T = ids.shape
        start = cache.length if cache is not None else 0
        S = start + T
        need = int(positions.max()) + 1
        if need > self.max_positions:
            raise ConfigError(f"sequence longer than the model's {self.max_positions} positions",
                              field="max_new_tokens")
        if need > self.cos.shape[0]:
            self._rope_tables(min(self.max_positions, max(need, 2 * self.cos.shape[0])))
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, d]
        full, sliding = self._masks(key_valid, start, T)
        x = self.embed[ids]
        nq, nkv, d = self.n_heads, self.n_kv, self.head_dim
        for li, layer in enumerate(self.layers):
            h = self._norm(x, layer.ln1)
            if layer.fused:
                qkv = linear(h, layer.qkv[0], layer.qkv_bias[0] if layer.qkv_bias is not None else None)
            else:
                qkv = _project(h, layer.qkv, layer.qkv_bias)
            qkv = qkv.view(B, T, nq + 2 * nkv, d)
            if layer.qk_norm is not None:  # Qwen3: RMSNorm over each head's dimensions, before RoPE
                qk = self._norm(qkv[:, :, :nq + nkv], layer.qk_norm).transpose(1, 2)
                v = qkv[:, :, nq + nkv:].transpose(1, 2)
                qk = rotate(qk, cos, sin)
            else:
                qkv = qkv.transpose(1, 2)
                qk = rotate(qkv[:, :nq + nkv], cos, sin)  # queries and keys rotated together
                v = qkv[:, nq + nkv:]
            q, k = qk[:, :nq], qk[:, nq:]
            if cache is not None:
                cache.k[li, :, :, start:S] = k
                cache.v[li, :, :, start:S] = v
                k, v = cache.k[li, :, :, :S], cache.v[li, :, :, :S]
            mask = sliding if layer.sliding and sliding is not None else full
            if T == 1:
                # Decoding: the query heads sharing a KV head become that head's "query positions", so
                # no K/V copy for grouped-query attention (the same math as enable_gqa).
                a = F.scaled_dot_product_attention(q.reshape(B, nkv, nq // nkv, d), k, v, attn_mask=mask)
                a = a.reshape(B, 1, nq * d)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nq)
                a = a.transpose(1, 2).reshape(B, T, nq * d)
            x = x + linear(a, layer.wo, layer.o_bias)
            h = self._norm(x, layer.ln2)
            if layer.fused:
                gu = linear(h, layer.gate_up[0],
                              layer.gate_up_bias[0] if layer.gate_up_bias is not None else None)
            else:
                gu = _project(h, layer.gate_up, layer.gate_up_bias)
            gate, up = gu.chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down, layer.down_bias)
        if cache is not None:
            cache.length = S
        return self._norm(x, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(ids [B, L], positions [B, L], valid [B, L]) for left-padded sequences."""
    L = max(len(s) for s in seqs)
    pad = torch.tensor([L - len(s) for s in seqs], device=device)
    ids = torch.tensor([[pad_id] * (L - len(s)) + list(s) for s in seqs], device=device, dtype=torch.long)
    slot = torch.arange(L, device=device).view(1, L)
    positions = (slot - pad.view(-1, 1)).clamp(min=0)
    return ids, positions, slot >= pad.view(-1, 1)
