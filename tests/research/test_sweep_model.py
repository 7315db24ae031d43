"""The polysemanticity toy model: loss and metrics on hand-computed cases, the hand-written steps against
autograd and torch.optim, determinism across thread counts, and the paper's qualitative findings."""

from __future__ import annotations

import math

import pytest
import torch

from intellect_node.research import polysemanticity as P


def test_loss_hand_computed() -> None:
    # W W^T = [[1.25, 0.5], [0.5, 1]] -> (Y - I)^2 sums to 0.0625 + 2 * 0.25; sum|W| = 2.5.
    w = torch.tensor([[1.0, 0.5], [0.0, 1.0]])
    assert P.loss(w, 0.1).item() == pytest.approx(0.5625 + 0.25)
    # Opposite signs on a shared neuron: the -1 off-diagonal is cut by the ReLU, so only L1 remains.
    w = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert P.loss(w, 1e-3).item() == pytest.approx(2e-3)
    # Same signs on a shared neuron interfere: off-diagonals of 1 each.
    w = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert P.loss(w, 0.0).item() == pytest.approx(2.0)


def test_polysemantic_count_hand_cases() -> None:
    w = torch.zeros(4, 5)
    w[0, 0], w[1, 0] = 0.9, -1.1          # two features in the band: polysemantic
    w[0, 1], w[2, 1] = 0.79, 1.0          # 0.79 is below the band
    w[1, 2], w[3, 2] = 1.21, -1.0         # 1.21 is above the band
    w[2, 3], w[3, 3] = 0.8, -1.2          # both bounds are inclusive
    w[0, 4], w[1, 4], w[3, 4] = 1.0, -1.0, 1.0  # three features still counts once
    assert P.polysemantic_count(w) == 3


def test_sign_hash_ignores_small_changes_and_sees_flips() -> None:
    w = torch.tensor([[1.0, 0.01], [-0.98, 0.2]])
    h = P.sign_pattern_hash(w)
    assert P.sign_pattern_hash(w + 1e-4) == h
    assert P.sign_pattern_hash(w * torch.tensor([[1.0, 1.0], [-1.0, 1.0]])) != h
    assert P.sign_pattern_hash(w.T) != h  # the shape is part of the hash


def test_fourth_norm() -> None:
    assert P.fourth_norm(torch.eye(3, 5)) == pytest.approx(1.0)
    assert P.fourth_norm(torch.full((2, 4), 0.5)) == pytest.approx(4 * 0.5 ** 4)


def test_init_is_the_platform_independent_pcg64_stream() -> None:
    a = P.init_weights(8, 16, 3)
    assert torch.equal(a, P.init_weights(8, 16, 3))
    assert not torch.equal(a, P.init_weights(8, 16, 4))
    assert a.dtype == torch.float32
    # numpy's PCG64 + standard_normal is specified bit for bit; pin two values of the stream.
    import numpy as np

    ref = np.random.Generator(np.random.PCG64(np.random.SeedSequence([3, 8, 16]))).standard_normal(2)
    assert a[0, 0].item() == pytest.approx(float(ref[0]) / 4, abs=1e-7)
    assert a[0, 1].item() == pytest.approx(float(ref[1]) / 4, abs=1e-7)


def test_adamw_steps_match_autograd_and_torch_optim() -> None:
    torch.set_num_threads(1)
    n, m, steps = 6, 10, 60
    w = P.init_weights(n, m, 7).requires_grad_(True)
    opt = torch.optim.AdamW([w], lr=1e-3, foreach=False)  # torch's default weight decay, 0.01
    for _ in range(steps):
        opt.zero_grad()
        torch.autograd.backward(P.loss(w, 1e-3))
        opt.step()
    fast = P.train_polysemanticity(n, m, 7, steps=steps)
    assert torch.allclose(fast, w.detach(), atol=1e-6)


def test_noisy_sgd_steps_match_autograd() -> None:
    import numpy as np

    n, m, steps = 4, 6, 30
    w = P.init_weights(n, m, 2).requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.02)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([2, n, m, 1])))
    for nz in P.noise_batch("bernoulli", 0.1, rng, steps, n, m):
        opt.zero_grad()
        torch.autograd.backward(P.loss(w, 0.0, nz))
        opt.step()
    fast, curve = P.train_noise(n, m, 2, noise="bernoulli", sigma=0.1, steps=steps, record_every=10)
    assert torch.allclose(fast, w.detach(), atol=1e-6)
    assert [s for s, _ in curve] == [0, 10, 20, 30]
    assert curve[-1][1] == pytest.approx(P.fourth_norm(fast))


@pytest.mark.parametrize("threads", [1, 2])
def test_result_is_the_same_on_any_thread_count(threads: int) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        # train_* directly, unpinned: the checked summary must not depend on the pool size...
        w = P.train_polysemanticity(16, 32, 5, steps=800)
        # ...and run_* pins one thread, so everything, the float loss included, is identical.
        r = P.run_polysemanticity(16, 32, 5, steps=800)
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    assert (P.polysemantic_count(w), P.sign_pattern_hash(w)) == r.digest
    reference = _single_thread_reference()
    assert r == reference


_REF: list[P.RunResult] = []


def _single_thread_reference() -> P.RunResult:
    if not _REF:
        torch.set_num_threads(1)
        _REF.append(P.run_polysemanticity(16, 32, 5, steps=800))
    return _REF[0]


def test_training_learns_every_feature_and_finds_collisions() -> None:
    # n = 32, m = 64: theory n^2/(4m) = 4 polysemantic neurons; every feature is reconstructed.
    w = P.train_polysemanticity(32, 64, 0)
    y = torch.relu(w @ w.T)
    assert torch.allclose(torch.diagonal(y), torch.ones(32), atol=0.05)
    assert (y - torch.diag(torch.diagonal(y))).abs().max() < 0.05
    assert 1 <= P.polysemantic_count(w) <= 10
    # Trained weights sit near 0 or near +/-1, far from the sign-pattern threshold of 0.5.
    a = w.abs()
    assert int(((a > 0.3) & (a < 0.7)).sum()) == 0


def test_bernoulli_noise_drives_sparsity_gaussian_does_not() -> None:
    steps = 10_000
    _, bern = P.train_noise(8, 16, 0, noise="bernoulli", sigma=0.1, steps=steps, record_every=steps)
    _, gauss = P.train_noise(8, 16, 0, noise="gaussian", sigma=0.1, steps=steps, record_every=steps)
    start = bern[0][1]
    assert gauss[0][1] == start and start == pytest.approx(3 / 16, rel=0.5)  # ~3/m at init
    assert bern[-1][1] > start + 0.03
    assert gauss[-1][1] < start
    assert not math.isnan(bern[-1][1])
