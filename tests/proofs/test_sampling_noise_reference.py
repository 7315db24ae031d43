"""The Gumbel noise as computed (per distinct position, in place, blocked, the integer part in numpy on
CPU) equals the definition written as one whole-tensor expression, bit for bit."""

from __future__ import annotations

import torch

from intellect_node.proofs.sampling import gumbel_noise

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def reference(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """docs/rollouts.md's G(key, i, v), as the first version of proofs/sampling.py computed it."""
    tok = torch.arange(vocab, dtype=torch.int64).view(1, -1)
    z = _mix(keys.view(-1, 1) + _mix(positions.view(-1, 1) * _GOLDEN + tok) * _GOLDEN)
    u = (_shr(z, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))
    return (-torch.log(-torch.log(u))).to(torch.float32)


def test_noise_equals_the_definition_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(3)
    for vocab, rows in ((1, 5), (50, 37), (4097, 9), (49152, 6), (70001, 3)):  # 70001: past one block
        keys = torch.randint(-2**63, 2**63 - 1, (rows,), generator=g, dtype=torch.int64)
        keys[0] = -2**63  # the extremes wrap like the rest
        keys[-1] = 2**63 - 1
        positions = torch.randint(0, 4096, (rows,), generator=g)
        positions[: rows // 2] = 7  # rows sharing a position share its hash table row
        assert torch.equal(gumbel_noise(keys, positions, vocab), reference(keys, positions, vocab))
