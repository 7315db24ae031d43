"""A lean Llama forward pass over plain tensors, shared by the torch engine and the verifier's prefill.

It computes what transformers' ``LlamaForCausalLM`` computes (RMSNorm, rotary embeddings in the
rotate-half layout, grouped-query attention, SwiGLU MLP) with fused QKV and gate/up projections and no
module overhead, because on small models the per-step Python cost, not the arithmetic, bounds decoding.
Generation and verification run the same code, so an honest rollout's hidden states agree closely (fp32:
near bit-exact) between worker and validator.

Batches are left-padded: row ``r`` has ``pad[r]`` pad slots, its positions start at 0 after them, and a
boolean mask hides pad slots as keys. Pad slots attend to themselves only, so no row is fully masked
(which would give NaN rows that poison the attention of others via 0 * NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from intellect_node.errors import ConfigError
from intellect_node.models.loader import LoadedModel


@dataclass
class KVCache:
    """Static cache: ``k``/``v`` of shape [layers, B, kv_heads, max_len, head_dim]; ``length`` filled."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


class LlamaRunner:
    def __init__(self, loaded: LoadedModel, device: str | torch.device = "cpu") -> None:
        cfg, st = loaded.config, loaded.state
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = next(iter(st.values())).dtype
        self.hidden_size = int(cfg["hidden_size"])
        self.n_layers = int(cfg["num_hidden_layers"])
        self.n_heads = int(cfg["num_attention_heads"])
        self.n_kv = int(cfg.get("num_key_value_heads") or self.n_heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden_size // self.n_heads)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.max_positions = int(cfg.get("max_position_embeddings", 2048))
        self.vocab_size = int(cfg["vocab_size"])
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
        if (cfg.get("rope_scaling") not in (None, {}) or rope.get("rope_type", "default") != "default"
                or cfg.get("hidden_act", "silu") != "silu"):
            raise ConfigError("only plain RoPE and SiLU Llama models are supported", field="model")

        def w(name: str) -> torch.Tensor:
            try:
                return st[name].to(self.device)
            except KeyError:
                raise ConfigError(f"{loaded.path}: weight {name} missing", field="model") from None

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = st["lm_head.weight"].to(self.device) if "lm_head.weight" in st else self.embed
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            self.layers.append((
                w(p + "input_layernorm.weight"),
                torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                           w(p + "self_attn.v_proj.weight")]),
                w(p + "self_attn.o_proj.weight"),
                w(p + "post_attention_layernorm.weight"),
                torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                w(p + "mlp.down_proj.weight"),
            ))
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype)
        self.sin = emb.sin().to(self.device, self.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32, then the weight in the model dtype (as transformers does).
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (self.n_layers, batch, self.n_kv, max_len, self.head_dim)
        return KVCache(torch.zeros(shape, device=self.device, dtype=self.dtype),
                       torch.zeros(shape, device=self.device, dtype=self.dtype))

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
        if int(positions.max()) >= self.max_positions:
            raise ConfigError(f"sequence longer than the model's {self.max_positions} positions",
                              field="max_new_tokens")
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, d]
        # Causal over slots, real keys only; pad queries see themselves (see module docstring).
        q_slot = torch.arange(start, S, device=self.device).view(T, 1)
        k_slot = torch.arange(S, device=self.device).view(1, S)
        allowed = (k_slot <= q_slot).unsqueeze(0) & key_valid[:, :S].unsqueeze(1)   # [B, T, S]
        allowed = allowed | (k_slot == q_slot).unsqueeze(0)
        # One additive mask per call, shared by every layer (SDPA would convert a boolean one per layer).
        mask = torch.zeros(allowed.shape, device=self.device, dtype=self.dtype).masked_fill_(
            ~allowed, float("-inf")).unsqueeze(1)
        x = self.embed[ids]
        nq, nkv, d = self.n_heads, self.n_kv, self.head_dim
        for li, (ln1, wqkv, wo, ln2, wgu, wdown) in enumerate(self.layers):
            h = self._norm(x, ln1)
            qkv = F.linear(h, wqkv).view(B, T, nq + 2 * nkv, d).transpose(1, 2)
            qk = self._rope(qkv[:, :nq + nkv], cos, sin)  # queries and keys rotated together
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
            if cache is not None:
                cache.k[li, :, :, start:S] = k
                cache.v[li, :, :, start:S] = v
                k, v = cache.k[li, :, :, :S], cache.v[li, :, :, :S]
            if T == 1:
                # Decoding: the query heads sharing a KV head become that head's "query positions", so
                # no K/V copy for grouped-query attention (the same math as enable_gqa).
                a = F.scaled_dot_product_attention(q.reshape(B, nkv, nq // nkv, d), k, v, attn_mask=mask)
                a = a.reshape(B, 1, nq * d)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nq)
                a = a.transpose(1, 2).reshape(B, T, nq * d)
            x = x + F.linear(a, wo)
            gate, up = F.linear(self._norm(x, ln2), wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wdown)
        if cache is not None:
            cache.length = S
        return self._norm(x, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(ids [B, L], positions [B, L], valid [B, L]) for left-padded sequences."""
    L = max(len(s) for s in seqs)
    pad = torch.tensor([L - len(s) for s in seqs], device=device)
    ids = torch.tensor([[pad_id] * (L - len(s)) + list(s) for s in seqs], device=device, dtype=torch.long)
    slot = torch.arange(L, device=device).view(1, L)
    positions = (slot - pad.view(-1, 1)).clamp(min=0)
    return ids, positions, slot >= pad.view(-1, 1)
