"""TOPLOC proofs: the top-k of the last hidden states, committed as a polynomial over a prime field.

The scheme is the TOPLOC paper's (Ong et al., 2025), in its reference library's byte format, written here
from the description:

* Generated tokens are taken in chunks of 32 (``decode_batching_size``). For a chunk, the hidden states
  that produced its tokens (final-norm output, shape ``[c, hidden]``) are flattened; the ``k = 128``
  entries of largest magnitude are selected; their flat indices ``x_i`` and bfloat16 bit patterns
  ``y_i`` (16-bit integers) are the points.
* A modulus ``m`` (searched downward from the prime 65497) makes ``x_i mod m`` distinct; the unique
  polynomial of degree < k through ``(x_i mod m, y_i)`` over GF(65497) is found by Newton's divided
  differences and stored by its monomial coefficients.
* Bytes: ``m`` as 2 bytes big-endian, then the k coefficients as 2 bytes big-endian each: 258 bytes.

To verify, the validator takes *its own* top-k of the recomputed hidden states, evaluates the polynomial
at its indices and compares bfloat16 exponent and mantissa bits: the number of exponent mismatches and the
mean and median absolute mantissa difference where exponents agree (larger means further from honest).
Thresholds come from calibration (``inference/calibrate.py``), not from here.

Shortcuts and choices:
* Top-k is selected on the fp32 magnitudes (fewer ties than on rounded values) and the values are then
  rounded to bfloat16, on both sides, so an fp32 pipeline is committed at bfloat16 precision.
* Values whose bf16 pattern is NaN/inf raise :class:`ProofError`; there is no "null proof". A chunk
  with fewer than k values (a model with a hidden size under 128 and a completion shorter than
  k / hidden tokens in its last chunk, e.g. a single EOS) is zero-padded to k on both sides, so its
  proof commits every value it has; real models (hidden size >= 128) never need it.
* The field arithmetic is vectorised with numpy over all chunks of a batch at once (int64, products of
  two residues < 2^32 never overflow), with modular inverses from a table built once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from intellect_node.errors import IntellectNodeError, ProtocolError

PRIME = 65497
"""The largest prime below 2^16 minus a margin, as in the reference library: coefficients fit 2 bytes."""
TOPK = 128
CHUNK = 32
PROOF_BYTES = 2 + 2 * TOPK
_MIN_MODULUS = 1 << 15


class ProofError(IntellectNodeError):
    """The scheme cannot commit to these activations (non-finite values, too few entries, ...)."""


_INV: np.ndarray | None = None
_INV_F64: np.ndarray | None = None


def _signed_inverses() -> np.ndarray:
    """Table t with t[d + p] = d^(p-2) mod p for d in (-p, p) (d = 0 is never used)."""
    global _INV
    if _INV is None:
        a = np.arange(PRIME, dtype=np.int64)
        result = np.ones_like(a)
        base, e = a.copy(), PRIME - 2
        while e:
            if e & 1:
                result = result * base % PRIME
            base = base * base % PRIME
            e >>= 1
        _INV = np.concatenate([result[(np.arange(-PRIME, 0)) % PRIME], result])
    return _INV


@dataclass(frozen=True)
class ProofPoly:
    modulus: int
    coeffs: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return self.modulus.to_bytes(2, "big") + b"".join(c.to_bytes(2, "big") for c in self.coeffs)

    @classmethod
    def from_bytes(cls, data: bytes, topk: int = TOPK) -> "ProofPoly":
        if len(data) != 2 + 2 * topk:
            raise ProtocolError(f"a TOPLOC proof has {2 + 2 * topk} bytes, got {len(data)}")
        vals = np.frombuffer(data, dtype=">u2").astype(np.int64)
        modulus = int(vals[0])
        if not topk <= modulus <= PRIME:
            raise ProtocolError(f"TOPLOC modulus {modulus} out of range")
        if (vals[1:] >= PRIME).any():
            raise ProtocolError("TOPLOC coefficient outside the field")
        return cls(modulus, tuple(int(v) for v in vals[1:]))

    def evaluate(self, x: np.ndarray) -> np.ndarray:
        """P(x mod m) for an int64 array ``x``, by Horner's rule."""
        xm = x.astype(np.int64) % self.modulus
        acc = np.zeros_like(xm)
        for c in reversed(self.coeffs):
            acc = (acc * xm + c) % PRIME
        return acc


def _signed_inverses_f64() -> np.ndarray:
    global _INV_F64
    if _INV_F64 is None:
        _INV_F64 = _signed_inverses().astype(np.float64)
    return _INV_F64


def _find_modulus(idx: np.ndarray) -> int:
    """The largest m <= PRIME with idx mod m distinct (indices are distinct, so PRIME when all < PRIME)."""
    if int(idx.max()) < PRIME:
        return PRIME
    for m in range(PRIME, _MIN_MODULUS, -1):
        if np.unique(idx % m).size == idx.size:
            return m
    raise ProofError("no modulus makes the top-k indices distinct")


def _reduce(a: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``a`` mod PRIME, in place, for float64 arrays of exact integers below 2^50 in magnitude.

    floor(a / p) computed as floor(a * (1/p)) can be off by one, so the result lies in [-p, 2p); callers
    only need a small representative until :func:`interpolate` normalises at the end. Float64 is used
    because numpy's int64 remainder is a division per element, several times slower.
    """
    np.multiply(a, 1.0 / PRIME, out=scratch)
    np.floor(scratch, out=scratch)
    scratch *= PRIME
    a -= scratch
    return a


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Monomial coefficients [P, n] of the polynomials through points (x[p, i], y[p, i]) over GF(PRIME).

    ``x`` rows must be distinct residues. Newton divided differences, then the Newton form is expanded
    from the innermost term outwards (Horner on polynomials), touching only the live low-degree part.
    Works on the transposed [n, P] layout so every slice is contiguous, with preallocated buffers; all
    intermediate values stay below 2^36 in magnitude, exact in float64.
    """
    inv = _signed_inverses_f64()
    xi = np.ascontiguousarray((x.astype(np.int64) % PRIME).T)          # [n, P]
    xf = xi.astype(np.float64)
    dd = np.ascontiguousarray((y.astype(np.int64) % PRIME).T).astype(np.float64)
    n = xi.shape[0]
    tmp, q = np.empty_like(dd), np.empty_like(dd)
    for k in range(1, n):
        m = n - k
        num = tmp[:m]
        np.subtract(dd[k:], dd[k - 1:-1], out=num)   # |num| < 3p
        num *= inv[xi[k:] - xi[:-k] + PRIME]         # * (x_i - x_{i-k})^-1
        dd[k:] = _reduce(num, q[:m])
    acc = np.zeros_like(dd)
    acc[0] = dd[n - 1]
    buf = np.empty_like(dd)
    for i in range(n - 2, -1, -1):
        d = n - 1 - i  # degree of acc after this step
        new = buf[:d + 1]
        new[1:] = acc[:d]
        new[0] = dd[i]
        np.multiply(acc[:d], xf[i], out=q[:d])
        new[:d] -= q[:d]                               # acc * (X - x_i) + dd_i
        acc[:d + 1] = _reduce(new, q[:d + 1])
    return np.ascontiguousarray((acc.astype(np.int64) % PRIME).T)


def _chunks(hidden: torch.Tensor, chunk: int, topk: int) -> list[torch.Tensor]:
    """The flattened chunks; one with fewer than ``topk`` values is zero-padded to exactly ``topk``, so
    its proof commits every value it has (prover and verifier pad alike)."""
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise ProofError(f"expected hidden states [tokens, hidden], got {tuple(hidden.shape)}")
    out = [hidden[i:i + chunk].reshape(-1) for i in range(0, hidden.shape[0], chunk)]
    return [f if f.numel() >= topk else torch.cat([f, f.new_zeros(topk - f.numel())]) for f in out]


def _topk(flat: torch.Tensor, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices and bf16 bit patterns (as non-negative ints) of the top-k magnitudes.

    ``flat`` is one chunk ``[values]`` or several chunks of equal size ``[chunks, values]``. The set is
    what matters (the points of a polynomial), not its order, so a linear-time partition replaces a sort.
    """
    if flat.shape[-1] < topk:
        raise ProofError(f"a chunk has {flat.shape[-1]} values, fewer than top-k {topk}")
    f32 = flat.detach().float().cpu()
    arr = f32.numpy()
    idx = np.argpartition(np.abs(arr), -topk, axis=-1)[..., -topk:]
    vals = torch.from_numpy(np.take_along_axis(arr, idx, axis=-1))
    bits = vals.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return idx.astype(np.int64), bits.numpy().astype(np.int64)


def build_proofs(hidden: torch.Tensor, *, chunk: int = CHUNK, topk: int = TOPK) -> list[bytes]:
    """Proofs for one rollout's generated-token hidden states ``[n_tokens, hidden]``."""
    return build_proofs_batch([hidden], chunk=chunk, topk=topk)[0]


def build_proofs_batch(hiddens: Sequence[torch.Tensor], *, chunk: int = CHUNK,
                       topk: int = TOPK) -> list[list[bytes]]:
    """Proofs for many rollouts at once: one top-k per chunk shape, one vectorised interpolation."""
    groups: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # chunk size -> (rollout, chunk no, values)
    for r, h in enumerate(hiddens):
        for c, flat in enumerate(_chunks(h, chunk, topk)):
            groups.setdefault(flat.numel(), []).append((r, c, flat))
    keys, xs, ys, mods = [], [], [], []
    for members in groups.values():
        idx, bits = _topk(torch.stack([f for _, _, f in members]), topk)
        # NaN and inf always land in the top-k (the partition orders NaN last), and so does any value
        # that overflows bfloat16: all have an all-ones exponent, so this one check covers them.
        if ((bits & 0x7F80) == 0x7F80).any():
            raise ProofError("hidden states contain NaN or inf, or values that overflow bfloat16")
        for (r, c, _), i_row, b_row in zip(members, idx, bits):
            m = _find_modulus(i_row)
            keys.append((r, c))
            xs.append(i_row % m)
            ys.append(b_row)
            mods.append(m)
    out: list[list[bytes]] = [[] for _ in hiddens]
    if not keys:
        return out
    coeffs = interpolate(np.stack(xs), np.stack(ys)).astype(">u2")
    for (r, _), m, row in sorted(zip(keys, mods, coeffs), key=lambda t: t[0]):
        out[r].append(m.to_bytes(2, "big") + row.tobytes())
    return out


@dataclass(frozen=True)
class ChunkResult:
    """Distance of one chunk's recomputed top-k from the committed values (larger = further)."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float


def verify_proofs(hidden: torch.Tensor, proofs: Sequence[bytes], *, chunk: int = CHUNK,
                  topk: int = TOPK) -> list[ChunkResult]:
    """Compare the recomputed hidden states ``[n_tokens, hidden]`` with the committed proofs.

    ProtocolError for malformed proof bytes or a proof count that does not match the tokens.
    """
    return verify_proofs_batch([hidden], [proofs], chunk=chunk, topk=topk)[0]


def verify_proofs_batch(hiddens: Sequence[torch.Tensor], proofs: Sequence[Sequence[bytes]], *,
                        chunk: int = CHUNK, topk: int = TOPK) -> list[list[ChunkResult]]:
    """:func:`verify_proofs` for many rollouts, evaluating all polynomials in one vectorised pass."""
    groups: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    polys: list[ProofPoly] = []
    keys: list[tuple[int, int]] = []
    for r, (h, ps) in enumerate(zip(hiddens, proofs, strict=True)):
        flats = _chunks(h, chunk, topk)
        if len(ps) != len(flats):
            raise ProtocolError(f"{len(ps)} proofs for {len(flats)} chunks of {chunk} tokens")
        for c, (flat, raw) in enumerate(zip(flats, ps)):
            polys.append(ProofPoly.from_bytes(raw, topk))
            groups.setdefault(flat.numel(), []).append((r, c, flat))
    results: list[list[ChunkResult]] = [[] for _ in hiddens]
    if not polys:
        return results
    poly_of = {}
    i = 0
    for r, ps in enumerate(proofs):
        for c in range(len(ps)):
            poly_of[(r, c)] = polys[i]
            i += 1
    idx_rows, bit_rows = [], []
    for members in groups.values():
        idx, bits = _topk(torch.stack([f for _, _, f in members]), topk)
        for (r, c, _), i_row, b_row in zip(members, idx, bits):
            keys.append((r, c))
            idx_rows.append(i_row)
            bit_rows.append(b_row)
    mods = np.array([[poly_of[k].modulus] for k in keys], dtype=np.int64)
    coeffs = np.array([poly_of[k].coeffs for k in keys], dtype=np.int64)
    xm = np.stack(idx_rows) % mods
    claimed = np.zeros_like(xm)
    for j in range(topk - 1, -1, -1):  # Horner, all chunks at once
        claimed = (claimed * xm + coeffs[:, j:j + 1]) % PRIME
    bits = np.stack(bit_rows)
    exp_mismatch = (claimed & 0x7F80) != (bits & 0x7F80)
    mant_err = np.abs((claimed & 0x7F) - (bits & 0x7F))
    for (r, _), mism, err in sorted(zip(keys, exp_mismatch, mant_err), key=lambda t: t[0]):
        ok = err[~mism]
        if ok.size:
            mean, median = float(ok.mean()), float(np.sort(ok)[ok.size // 2])
        else:
            mean = median = float(2 ** 64)
        results[r].append(ChunkResult(int(mism.sum()), mean, median))
    return results
