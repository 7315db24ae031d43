"""The toy model of "What Causes Polysemanticity?" (Lecomte et al., arXiv 2312.03096), made checkable.

The experiment (facts from the paper and its authors' public code; the code here is our own):

- inputs are all ``n`` one-hot vectors, every step (full batch); ``m >= n`` neurons;
- tied weights ``W`` (n x m), no bias: hidden ``h = W^T x``, output ``y = ReLU(W h)``, so for the whole
  batch ``Y = ReLU(W W^T)``; loss ``sum((Y - I)^2) + l1 * sum(|W|)``;
- ``W ~ N(0, 1/m)``; AdamW (lr 1e-3, torch's default weight decay 0.01), 7500 steps, ``l1 = 1e-3``;
- a neuron is *polysemantic* when at least two features have ``0.8 <= |W_ih| <= 1.2``; theory predicts
  about ``n^2 / (4m)`` of them;
- noise variant: ``l1 = 0``, n = 8, m = 16, plain SGD lr 0.02, 100k steps, noise added to the hidden
  layer (Bernoulli +/- sigma or Gaussian sigma); metric: mean over features of ``sum_h W_ih^4``.

Shortcuts and choices, on purpose:

- The gradients and the optimizer steps are written out by hand instead of autograd + ``torch.optim``:
  the same arithmetic (``tests/research/test_sweep_model.py`` checks it against autograd and
  ``torch.optim.AdamW`` / ``SGD``) at 4-7 times the speed, which matters when a sweep is thousands of runs.
- Determinism: the initial weights and every noise sample come from numpy's PCG64 seeded with
  ``(seed, n, m[, stream])``, which gives the same numbers on every platform; each run pins torch to one
  thread. Float results can still differ in the last bits between CPU instruction sets, so a run is
  summarised for checking by its polysemantic count and a hash of the *sign pattern of the thresholded
  weights* (entries with ``|W| >= 0.5`` as +1/-1, the rest 0): trained weights sit near 0 or near +/-1,
  far from the threshold. Raw floats are never compared.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator, Literal

import numpy as np
import torch

NoiseKind = Literal["none", "bernoulli", "gaussian"]

POLY_LO = 0.8
"""Lower bound of ``|W_ih|`` for a feature to count as represented by a neuron (the paper's setting)."""
POLY_HI = 1.2
"""Upper bound of the same band."""
SIGN_THRESHOLD = 0.5
"""Weights with ``|W| >= 0.5`` enter the sign pattern; halfway between the two clusters (0 and 1)."""

_NOISE_STREAM = 1  # extra SeedSequence entropy word that separates the noise stream from the init stream


@dataclass(frozen=True)
class RunResult:
    """What a run reports. ``polysemantic`` and ``sign_hash`` are what re-execution compares."""

    polysemantic: int
    sign_hash: str
    final_loss: float
    fourth_norm: tuple[tuple[int, float], ...] = ()  # (step, mean_i sum_h W_ih^4); noise variant only

    @property
    def digest(self) -> tuple[int, str]:
        return (self.polysemantic, self.sign_hash)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with torch's intra-op pool at one thread (process-wide), then restore it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rng(seed: int, n: int, m: int, *stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, n, m, *stream])))


def init_weights(n: int, m: int, seed: int) -> torch.Tensor:
    """``W ~ N(0, 1/m)`` elementwise, float32, identical on every platform for a given seed."""
    w = _rng(seed, n, m).standard_normal((n, m)) / math.sqrt(m)
    return torch.from_numpy(w.astype(np.float32))


def loss(w: torch.Tensor, l1: float, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``sum((ReLU((W + N) W^T) - I)^2) + l1 * sum|W|``, differentiable: the reference the fast steps
    follow."""
    h = w if noise is None else w + noise
    y = torch.relu(h @ w.T)
    return ((y - torch.eye(w.shape[0], dtype=w.dtype)) ** 2).sum() + l1 * w.abs().sum()


def polysemantic_count(w: torch.Tensor, lo: float = POLY_LO, hi: float = POLY_HI) -> int:
    """Neurons (columns of ``w``) on which at least two features have ``lo <= |W_ih| <= hi``."""
    a = w.abs()
    per_neuron = ((a >= lo) & (a <= hi)).sum(dim=0)
    return int((per_neuron >= 2).sum())


def sign_pattern_hash(w: torch.Tensor, threshold: float = SIGN_THRESHOLD) -> str:
    """sha256 (hex) of the int8 matrix ``sign(W) * (|W| >= threshold)`` in row-major order, with its shape."""
    pattern = (torch.sign(w) * (w.abs() >= threshold)).to(torch.int8).contiguous().numpy()
    h = hashlib.sha256(f"{w.shape[0]}x{w.shape[1]}:".encode())
    h.update(pattern.tobytes())
    return h.hexdigest()


def fourth_norm(w: torch.Tensor) -> float:
    """Mean over features of ``sum_h W_ih^4``: 1 when each feature sits on one unit-norm neuron, ~3/m at
    init."""
    return float((w.double() ** 4).sum(dim=1).mean())


def train_polysemanticity(n: int, m: int, seed: int, *, steps: int = 7500, lr: float = 1e-3,
                          l1: float = 1e-3, weight_decay: float = 1e-2) -> torch.Tensor:
    """Train the tied-weight toy model with AdamW (betas 0.9/0.999, eps 1e-8, torch's defaults).

    Gradient of ``sum((ReLU(A) - I)^2)`` with ``A = W W^T`` (symmetric): ``4 * ((A - I) * [A > 0]) @ W``;
    the L1 term adds ``l1 * sign(W)`` (0 at 0, as autograd does).
    """
    b1, b2, eps = 0.9, 0.999, 1e-8
    w = init_weights(n, m, seed)
    eye = torch.eye(n)
    exp_avg = torch.zeros_like(w)
    exp_avg_sq = torch.zeros_like(w)
    a = torch.empty(n, n)
    grad = torch.empty_like(w)
    denom = torch.empty_like(w)
    for t in range(1, steps + 1):
        torch.mm(w, w.T, out=a)
        mask = a > 0
        a.sub_(eye).mul_(mask)
        torch.mm(a, w, out=grad)
        grad.mul_(4.0)
        if l1:
            grad.add_(torch.sign(w), alpha=l1)
        # AdamW: decoupled decay first, then the Adam step with bias corrections (as torch.optim.AdamW).
        w.mul_(1.0 - lr * weight_decay)
        exp_avg.lerp_(grad, 1.0 - b1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        torch.sqrt(exp_avg_sq, out=denom)
        denom.div_(math.sqrt(1.0 - b2 ** t)).add_(eps)
        w.addcdiv_(exp_avg, denom, value=-lr / (1.0 - b1 ** t))
    return w


def noise_batch(kind: NoiseKind, sigma: float, rng: np.random.Generator, count: int, n: int,
                m: int) -> torch.Tensor:
    """``count`` noise matrices (count x n x m) for the hidden layer, float32."""
    if kind == "bernoulli":
        signs = rng.integers(0, 2, size=(count, n, m), dtype=np.int8) * 2 - 1
        return torch.from_numpy(signs.astype(np.float32) * np.float32(sigma))
    if kind == "gaussian":
        return torch.from_numpy((rng.standard_normal((count, n, m)) * sigma).astype(np.float32))
    if kind == "none":
        return torch.zeros(count, n, m)
    raise ValueError(f"unknown noise kind {kind!r}; use none, bernoulli or gaussian")


def train_noise(n: int, m: int, seed: int, *, noise: NoiseKind, sigma: float, steps: int = 100_000,
                lr: float = 0.02, l1: float = 0.0, record_every: int = 1000,
                chunk: int = 1000) -> tuple[torch.Tensor, tuple[tuple[int, float], ...]]:
    """Plain SGD with noise ``N`` on the hidden layer: ``Y = ReLU((W + N) W^T)``.

    With ``G = 2 (Y - I) * [A > 0]`` and ``H = W + N``, the gradient is ``G W + G^T H`` (W enters twice).
    Returns the final weights and the fourth-norm curve sampled every ``record_every`` steps (and at 0).
    """
    w = init_weights(n, m, seed)
    rng = _rng(seed, n, m, _NOISE_STREAM)
    eye = torch.eye(n)
    curve: list[tuple[int, float]] = [(0, fourth_norm(w))]
    grad = torch.empty_like(w)
    step = 0
    while step < steps:
        batch = noise_batch(noise, sigma, rng, min(chunk, steps - step), n, m)
        for nz in batch:
            h = w + nz
            a = h @ w.T
            g = (a.clamp(min=0) - eye).mul_(a > 0).mul_(2.0)
            torch.mm(g, w, out=grad)
            grad.addmm_(g.T, h)
            if l1:
                grad.add_(torch.sign(w), alpha=l1)
            w.sub_(grad, alpha=lr)
            step += 1
            if step % record_every == 0:
                curve.append((step, fourth_norm(w)))
    return w, tuple(curve)


def run_polysemanticity(n: int, m: int, seed: int, *, steps: int = 7500, lr: float = 1e-3,
                        l1: float = 1e-3, weight_decay: float = 1e-2) -> RunResult:
    """One run of the main experiment on one thread, summarised for checking."""
    with one_thread():
        w = train_polysemanticity(n, m, seed, steps=steps, lr=lr, l1=l1, weight_decay=weight_decay)
        final = float(loss(w, l1))
    return RunResult(polysemantic=polysemantic_count(w), sign_hash=sign_pattern_hash(w), final_loss=final)


def run_noise(n: int, m: int, seed: int, *, noise: NoiseKind, sigma: float, steps: int = 100_000,
              lr: float = 0.02, l1: float = 0.0, record_every: int = 1000) -> RunResult:
    """One run of the noise variant on one thread, with its fourth-norm curve."""
    with one_thread():
        w, curve = train_noise(n, m, seed, noise=noise, sigma=sigma, steps=steps, lr=lr, l1=l1,
                               record_every=record_every)
        final = float(loss(w, l1))
    return RunResult(polysemantic=polysemantic_count(w), sign_hash=sign_pattern_hash(w), final_loss=final,
                     fourth_norm=curve)
