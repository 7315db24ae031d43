"""Helpers for the delta tests: policies from real AdamW steps (blob peers on 127.0.0.1 are the product's
``intellect_node.blobs.peer.BlobPeer``)."""

from __future__ import annotations

import torch

from intellect_node.policy.weights import PolicyWeights


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64))


def policy_versions(dtype: torch.dtype, n: int, lr: float = 3e-5) -> list[PolicyWeights]:
    """``n`` consecutive policies from real AdamW steps (fp32 master weights, published in ``dtype``)."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        out.append(PolicyWeights.from_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()}))
        tokens = torch.randint(0, 64, (16, 8), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), tokens.roll(1, 1).reshape(-1))
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
    return out
