"""The two elementwise pieces the inference runner (``inference/decoder.py``) and the trainer's network
(``trainer/lean.py``) share, so that both compute exactly what transformers' decoders do."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` in float32, then times ``weight`` in ``x``'s dtype (as transformers)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding in the rotate-half layout (the two halves of the last dimension)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
