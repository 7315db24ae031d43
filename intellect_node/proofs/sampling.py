"""Reproducible sampling (Gumbel-max with counter-based noise) and the checks a validator runs with it.

The engine samples token ``t`` at completion position ``i`` of rollout ``r`` as

    argmax_v  [ log_softmax(logits / T)[v] + G(key_r, i, v) ]   over the top-p nucleus,

where ``G`` is standard Gumbel noise computed by hashing (key, position, token) with splitmix64, and
``key_r`` is derived from the rollout's seed and ID (:func:`rollout_key`). Gumbel-max draws exactly from
the softmax, so this *is* temperature/top-p sampling, but anyone holding the logits can redo it. A
validator that recomputes the logits by prefill checks that every claimed token is the argmax (up to a
calibrated numerical margin): a completion sampled by another model, or edited afterwards, is not.

The same functions run in the engine and in the validator, on any device: the noise is integer
arithmetic on int64 tensors (wrapping multiplication, logical shifts by masking), so CPU and GPU agree
bit for bit. Shortcuts: temperature must be > 0 (no greedy mode; a small temperature approximates it);
the nucleus is computed from the same float32 probabilities on both sides, and a token at the nucleus
boundary is accepted if it is inside a nucleus widened by ``top_p_slack``.

Seeds are not the worker's choice. A worker free to pick seeds could sample a problem many times and
submit the luckiest completions, which biases the group-relative advantages the trainer learns from.
In a run, the seed of the k-th sample of a problem's group is :func:`group_seed` of (run, policy version,
worker, problem, k) and the rollout ID follows from it (:func:`derived_rollout_id`), so a group is a fair
draw from the policy: the validator recomputes both. A worker can still choose *which* problems to
submit, but not which samples of a problem.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 multipliers as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MASKS = {s: (1 << (64 - s)) - 1 for s in (11, 27, 30, 31)}


def group_seed(run_id: str, policy_version: int, worker: str, problem_id: str, index: int) -> int:
    """The sampling seed (63 bits) of the ``index``-th sample of ``problem_id``'s group in a run."""
    h = hashlib.sha256(b"intellect/seed/1\0" + "\0".join((run_id, str(policy_version), worker, problem_id,
                                                          str(index))).encode("utf-8"))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def batch_seeds(run_id: str, policy_version: int, worker: str, problem_ids: Sequence[str]) -> list[int]:
    """Seeds of a batch's records in order: the k-th occurrence of a problem in the batch gets index k."""
    seen: dict[str, int] = {}
    out = []
    for pid in problem_ids:
        k = seen.get(pid, 0)
        seen[pid] = k + 1
        out.append(group_seed(run_id, policy_version, worker, pid, k))
    return out


def derived_rollout_id(worker: str, seed: int) -> str:
    """The rollout ID that goes with a derived seed."""
    return f"{worker[-12:]}-{seed:016x}"


def rollout_key(seed: int, rollout_id: str) -> int:
    """A signed 64-bit noise key for one rollout, from its sampling seed and ID."""
    h = hashlib.sha256(b"intellect/gumbel/1\0" + seed.to_bytes(8, "big") + rollout_id.encode("utf-8"))
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def _shr_into(z: torch.Tensor, s: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` = logical right shift of int64 ``z`` by ``s`` (torch's >> is arithmetic, so mask)."""
    torch.bitwise_right_shift(z, s, out=out)
    return out.bitwise_and_(_MASKS[s])


def _mix_(z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 ``z``, in place (wrapping multiplication); ``scratch`` is z's size."""
    z ^= _shr_into(z, 30, scratch)
    z *= _M1
    z ^= _shr_into(z, 27, scratch)
    z *= _M2
    z ^= _shr_into(z, 31, scratch)
    return z


def _mix_np(z: np.ndarray, scratch: np.ndarray) -> None:
    """:func:`_mix_` on a uint64 view (CPU): numpy has logical shifts and wrapping multiplication for
    uint64, so each round is three operations instead of torch's four, and they ran ~2x faster."""
    for s, m in ((30, _U1), (27, _U2)):
        np.right_shift(z, s, out=scratch)
        z ^= scratch
        z *= m
    np.right_shift(z, 31, out=scratch)
    z ^= scratch


_U1, _U2 = np.uint64(_M1 + (1 << 64)), np.uint64(_M2 + (1 << 64))

_BLOCK = 1 << 15
"""Noise values computed per pass on CPU: each pass's int64/float64 buffers (four of 256 KiB) stay in
the core's L2 cache, where a pass over a whole [B, vocab] batch streamed every one of its ~20
elementwise operations through memory (measured 6x slower at 32 x 49152, one thread)."""


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[B, vocab]`` (float32) for rows with noise ``keys[B]`` at ``positions[B]``.

    ``G(key, i, v) = -log(-log(u))`` with ``u = (z >> 11 + 0.5) / 2^53`` and
    ``z = mix(key + mix(i * GOLDEN + v) * GOLDEN)``; deterministic in (key, position, token) alone, so batch
    composition and device do not matter. The inner hash depends on (position, token) only, so rows are
    taken by position: a block of the inner hash is computed once and used for every row at that
    position (a decoding step shares one position across the batch; a verifier's slice a few rollouts
    per position), and the rest runs in place over blocks that stay in cache. Every operation is
    elementwise integer arithmetic or the same float64 ``log``, so the values are those of the plain
    whole-tensor expression, bit for bit (tests/proofs/test_sampling_noise_reference.py).
    """
    keys = keys.to(torch.int64).view(-1)
    dev = keys.device
    cpu = dev.type == "cpu"
    key_list = keys.tolist()
    by_pos: dict[int, list[int]] = {}
    for r, p in enumerate(positions.view(-1).tolist()):
        by_pos.setdefault(int(p), []).append(r)
    out = torch.empty(keys.shape[0], vocab, device=dev, dtype=torch.float32)
    width = min(vocab, _BLOCK) if cpu else vocab  # a GPU wants few large kernels, not cache-sized blocks
    inner = torch.empty(width, device=dev, dtype=torch.int64)
    z, scratch = torch.empty_like(inner), torch.empty_like(inner)
    u = torch.empty(width, device=dev, dtype=torch.float64)
    for p, rows in by_pos.items():
        base = ((p * _GOLDEN) + (1 << 63)) % (1 << 64) - (1 << 63)  # i * GOLDEN, wrapped to int64
        row_t = torch.tensor(rows, device=dev) if not cpu else None
        for c0 in range(0, vocab, width):
            n = min(width, vocab - c0)
            ib, zb, sb, ub = inner[:n], z[:n], scratch[:n], u[:n]
            torch.arange(c0, c0 + n, out=ib).add_(base)
            if cpu:
                _mix_np(ib.numpy().view(np.uint64), sb.numpy().view(np.uint64))
            else:
                _mix_(ib, sb)
            ib.mul_(_GOLDEN)
            if not cpu:  # all rows of the position at once
                zr = ib.view(1, -1) + keys[row_t].view(-1, 1)
                sr = torch.empty_like(zr)
                _shr_into(_mix_(zr, sr), 11, sr)
                ur = sr.to(torch.float64).add_(0.5).mul_(1.0 / (1 << 53))
                out[row_t, c0:c0 + n] = ur.log_().neg_().log_().neg_().to(torch.float32)
                continue
            zn, sn = zb.numpy().view(np.uint64), sb.numpy().view(np.uint64)
            for r in rows:
                torch.add(ib, key_list[r], out=zb)
                _mix_np(zn, sn)
                np.right_shift(zn, 11, out=sn)
                # 53 random bits -> u in (0, 1), in float64 so -log(-log(u)) never sees 0 or 1.
                ub.copy_(sb).add_(0.5).mul_(1.0 / (1 << 53))
                out[r, c0:c0 + n] = ub.log_().neg_().log_().neg_()
    return out


def log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) in float32: the distribution the recorded logprobs refer to."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def nucleus_mask(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean ``[B, V]``: the smallest set of most likely tokens with mass >= top_p (always >= 1 token)."""
    if top_p >= 1.0:
        return torch.ones_like(logp, dtype=torch.bool)
    probs, order = torch.softmax(logp, dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, temperature: float,
           top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens [B] int64, their logprobs [B] float32)."""
    logp = log_probs(logits, temperature)
    scores = logp + gumbel_noise(keys, positions, logp.shape[-1])
    if top_p < 1.0:
        scores = scores.masked_fill(~nucleus_mask(logp, top_p), float("-inf"))
    tokens = scores.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens.view(-1, 1)).view(-1)


@dataclass(frozen=True)
class SamplingCheck:
    """Per-rollout figures: the largest sampling gap and the largest logprob difference."""

    max_gap: float
    """max over positions of (best Gumbel score - claimed token's score); 0 when every token is the argmax."""
    max_logprob_diff: float
    """max over positions of |claimed logprob - recomputed logprob|."""
    worst_position: int


def check_sampling(logits: torch.Tensor, tokens: torch.Tensor, claimed_logprobs: torch.Tensor, key: int,
                   temperature: float, top_p: float, top_p_slack: float = 1e-4) -> SamplingCheck:
    """Re-run the sampler on recomputed ``logits [n, V]`` for one rollout's completion ``tokens [n]``."""
    return check_sampling_many([logits], [tokens], [claimed_logprobs], [key], temperature, top_p,
                               top_p_slack)[0]


def check_sampling_many(logits: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor],
                        claimed_logprobs: Sequence[torch.Tensor], keys: Sequence[int], temperature: float,
                        top_p: float, top_p_slack: float = 1e-4) -> list[SamplingCheck]:
    """:func:`check_sampling` for several rollouts drawn with the same temperature and top-p, as one set
    of row-wise tensor operations over all their positions (a validator checks a batch's rollouts
    together: per rollout, the operations' fixed cost outweighed their work). Every operation is per row,
    so each rollout's figures are those it would get alone."""
    if not (len(logits) == len(tokens) == len(claimed_logprobs) == len(keys)):
        raise ValueError("logits, tokens, logprobs and keys disagree in number")
    lens = [int(x.shape[0]) for x in logits]
    for x, t, c, n in zip(logits, tokens, claimed_logprobs, lens):
        if x.dim() != 2 or t.shape != (n,) or c.shape != (n,):
            raise ValueError("logits, tokens and logprobs disagree in length")
    if not lens:
        return []
    all_logits = torch.cat(list(logits))
    device, vocab = all_logits.device, all_logits.shape[-1]
    logp = log_probs(all_logits, temperature)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    row_keys = torch.repeat_interleave(torch.tensor(list(keys), dtype=torch.int64, device=device),
                                       torch.tensor(lens, device=device))
    scores = logp + gumbel_noise(row_keys, pos, vocab)
    tok = torch.cat(list(tokens)).to(device=device, dtype=torch.int64).view(-1, 1)
    if top_p < 1.0:
        strict = nucleus_mask(logp, top_p)
        wide = nucleus_mask(logp, min(1.0, top_p + top_p_slack))
        best = scores.masked_fill(~strict, float("-inf")).max(dim=-1).values
        inside = wide.gather(-1, tok).view(-1)
    else:
        best = scores.max(dim=-1).values
        inside = torch.ones(len(tok), dtype=torch.bool, device=device)
    gap = best - scores.gather(-1, tok).view(-1)
    gap = torch.where(inside, gap, torch.full_like(gap, float("inf")))
    lp_diff = (logp.gather(-1, tok).view(-1) - torch.cat(list(claimed_logprobs)).to(logp)).abs()
    gaps, diffs, worse = gap.tolist(), lp_diff.tolist(), torch.maximum(gap, lp_diff).tolist()
    out, start = [], 0
    for n in lens:
        seg = slice(start, start + n)
        w = worse[seg]
        out.append(SamplingCheck(max(gaps[seg], default=float("-inf")),
                                 max(diffs[seg], default=float("-inf")), w.index(max(w)) if w else 0))
        start += n
    return out
