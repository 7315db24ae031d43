"""TOPLOC: byte format, interpolation, honest / perturbed / malicious cases, and hostile proof bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.proofs.toploc import (
    PRIME,
    PROOF_BYTES,
    ProofError,
    ProofPoly,
    build_proofs,
    build_proofs_batch,
    interpolate,
    verify_proofs,
)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_interpolation_passes_through_its_points(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 40))
    xs = data.draw(st.lists(st.integers(0, PRIME - 1), min_size=n, max_size=n, unique=True))
    ys = data.draw(st.lists(st.integers(0, PRIME - 1), min_size=n, max_size=n))
    coeffs = interpolate(np.array([xs]), np.array([ys]))[0]
    poly = ProofPoly(PRIME, tuple(int(c) for c in coeffs))
    assert poly.evaluate(np.array(xs)).tolist() == ys


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=600))
def test_random_proof_bytes_raise_only_protocol_error(raw: bytes) -> None:
    try:
        poly = ProofPoly.from_bytes(raw)
    except ProtocolError:
        return
    assert poly.to_bytes() == raw  # anything accepted round-trips exactly


@settings(max_examples=20, deadline=None)
@given(st.integers(128, PRIME), st.lists(st.integers(0, PRIME - 1), min_size=128, max_size=128))
def test_proof_bytes_round_trip(modulus: int, coeffs: list[int]) -> None:
    poly = ProofPoly(modulus, tuple(coeffs))
    raw = poly.to_bytes()
    assert len(raw) == PROOF_BYTES == 258
    assert raw[:2] == modulus.to_bytes(2, "big")
    assert ProofPoly.from_bytes(raw) == poly


def test_reference_byte_layout() -> None:
    """2-byte big-endian modulus, then 128 big-endian coefficients; one proof per 32 tokens."""
    h = torch.randn(70, 128, generator=torch.Generator().manual_seed(0))
    proofs = build_proofs(h)
    assert len(proofs) == 3 and all(len(p) == 258 for p in proofs)
    assert int.from_bytes(proofs[0][:2], "big") == PRIME  # indices < 4096 < PRIME: no search needed
    poly = ProofPoly.from_bytes(proofs[0])
    flat = h[:32].reshape(-1)
    idx = flat.abs().topk(128).indices
    bits = flat[idx].to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert poly.evaluate(idx.numpy()).tolist() == bits.tolist()


def test_large_hidden_size_searches_a_modulus() -> None:
    h = torch.randn(32, 4096, generator=torch.Generator().manual_seed(1))  # 131072 values > PRIME
    proofs = build_proofs(h)
    m = int.from_bytes(proofs[0][:2], "big")
    assert 1 << 15 < m <= PRIME
    assert verify_proofs(h, proofs)[0].exp_mismatches == 0


def test_honest_passes_perturbed_and_foreign_fail() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(96, 128, generator=g)
    proofs = build_proofs(h)
    honest = verify_proofs(h.clone(), proofs)
    assert all(r.exp_mismatches == 0 and r.mant_err_mean == 0 and r.mant_err_median == 0 for r in honest)
    tiny = verify_proofs(h + 1e-7 * torch.randn(h.shape, generator=g), proofs)
    assert all(r.exp_mismatches <= 2 and r.mant_err_mean < 0.5 for r in tiny)
    foreign = verify_proofs(torch.randn(96, 128, generator=g), proofs)
    assert all(r.exp_mismatches > 64 for r in foreign)
    # proofs of another rollout (same shape) do not fit this one
    other = build_proofs(torch.randn(96, 128, generator=g))
    assert all(r.exp_mismatches > 64 for r in verify_proofs(h, other))


def test_batch_build_equals_one_by_one() -> None:
    g = torch.Generator().manual_seed(3)
    hs = [torch.randn(n, 128, generator=g) for n in (1, 31, 32, 33, 70)]
    assert build_proofs_batch(hs) == [build_proofs(h) for h in hs]


def test_a_chunk_shorter_than_top_k_commits_every_value() -> None:
    """A model with hidden size 64 and a one-token completion (an EOS) has 64 values in its chunk: the
    proof commits all of them (zero-padded to k on both sides) instead of failing the worker's batch."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(33, 64, generator=g)  # a full chunk of 32 tokens, then one token of 64 values
    proofs = build_proofs(h)
    assert len(proofs) == 2 and all(len(p) == PROOF_BYTES for p in proofs)
    assert build_proofs_batch([h, h[:1]]) == [proofs, build_proofs(h[:1])]
    honest = verify_proofs(h.clone(), proofs)
    assert all(r.exp_mismatches == 0 and r.mant_err_mean == 0 for r in honest)
    edited = h.clone()
    edited[32] = torch.randn(64, generator=g)  # the short chunk's token came from other states
    short = verify_proofs(edited, proofs)[1]
    assert short.exp_mismatches > 16, short


def test_inputs_the_scheme_cannot_handle_raise() -> None:
    with pytest.raises(ProofError):
        build_proofs(torch.full((4, 128), float("nan")))
    with pytest.raises(ProofError):
        build_proofs(torch.full((2, 128), 1e39, dtype=torch.float64).float())  # inf
    with pytest.raises(ProofError):
        build_proofs(torch.randn(0, 128))
    for bad in (float("nan"), float("inf"), float("-inf"), 3.4e38):  # one bad value among normal ones
        h = torch.randn(40, 128)
        h[37, 5] = bad
        with pytest.raises(ProofError):
            build_proofs(h)


def test_verify_rejects_truncated_and_miscounted_proofs() -> None:
    h = torch.randn(40, 128)
    proofs = build_proofs(h)
    with pytest.raises(ProtocolError):
        verify_proofs(h, [proofs[0][:-2], proofs[1]])
    with pytest.raises(ProtocolError):
        verify_proofs(h, proofs[:1])
    with pytest.raises(ProtocolError):
        verify_proofs(h, [b"\xff\xff" + proofs[0][2:], proofs[1]])  # modulus above the prime
