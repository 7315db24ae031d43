"""The seeded Gumbel-max sampler: reproducible, a true softmax/top-p sampler, and checkable."""

from __future__ import annotations

import torch

from intellect_node.proofs.sampling import (
    check_sampling,
    check_sampling_many,
    gumbel_noise,
    nucleus_mask,
    rollout_key,
    sample,
)


def test_noise_depends_only_on_key_position_token() -> None:
    keys = torch.tensor([rollout_key(7, "a"), rollout_key(7, "b"), rollout_key(8, "a")])
    pos = torch.tensor([3, 3, 3])
    full = gumbel_noise(keys, pos, 50)
    alone = gumbel_noise(keys[1:2], pos[1:2], 50)
    assert torch.equal(full[1:2], alone)  # batch composition does not matter
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[0], full[2])
    assert not torch.equal(gumbel_noise(keys[:1], torch.tensor([4]), 50), full[:1])
    big = gumbel_noise(torch.tensor([rollout_key(1, "x")]), torch.tensor([0]), 200_000)
    assert abs(big.mean().item() - 0.5772) < 0.02 and abs(big.std().item() - 1.2825) < 0.02  # Gumbel(0, 1)


def test_frequencies_follow_softmax_and_top_p() -> None:
    n = 20_000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(n, 1)
    keys = torch.tensor([rollout_key(i, "freq") for i in range(n)])
    zeros = torch.zeros(n, dtype=torch.long)
    tok, lp = sample(logits, keys, zeros, 1.0, 1.0)
    freq = torch.bincount(tok, minlength=4) / n
    assert torch.allclose(freq, torch.softmax(logits[0], 0), atol=0.015)
    assert torch.allclose(lp, torch.log_softmax(logits[0], 0)[tok])
    tok, _ = sample(logits, keys, zeros, 0.5, 0.7)  # T=0.5 -> p = [.10, .75?]: nucleus {2} or {2, 1}
    p = torch.softmax(logits[0] / 0.5, 0)
    keep = nucleus_mask(torch.log(p).view(1, -1), 0.7)[0]
    assert set(torch.unique(tok).tolist()) <= set(keep.nonzero().view(-1).tolist())


def test_check_accepts_honest_and_flags_an_edited_token() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 100, generator=g) * 3
    key = rollout_key(5, "r1")
    toks, lps = [], []
    for i in range(40):
        t, lp = sample(logits[i:i + 1], torch.tensor([key]), torch.tensor([i]), 1.0, 0.9)
        toks.append(int(t))
        lps.append(float(lp))
    tokens, claimed = torch.tensor(toks), torch.tensor(lps)
    noisy = logits + 1e-6 * torch.randn(logits.shape, generator=g)
    honest = check_sampling(noisy, tokens, claimed, key, 1.0, 0.9)
    assert honest.max_gap < 1e-3 and honest.max_logprob_diff < 1e-3
    edited = tokens.clone()
    edited[17] = (edited[17] + 1) % 100
    bad = check_sampling(logits, edited, claimed, key, 1.0, 0.9)
    assert bad.worst_position == 17 and bad.max_gap > 1e-3
    other_seed = rollout_key(6, "r1")
    assert check_sampling(logits, tokens, claimed, other_seed, 1.0, 0.9).max_gap > 1e-3
    assert check_sampling(logits, tokens, claimed - 0.5, key, 1.0, 0.9).max_logprob_diff > 0.4


def test_checking_rollouts_together_gives_each_its_own_figures() -> None:
    """A validator checks a batch's rollouts in one pass (``check_sampling_many``): each rollout's figures
    are the ones it gets alone, and an edited token is pinned to its own rollout and position."""
    g = torch.Generator().manual_seed(1)
    rollouts = []
    for j, n in enumerate((5, 1, 9, 3)):
        logits = torch.randn(n, 50, generator=g) * 3
        key = rollout_key(j, f"r{j}")
        pairs = [sample(logits[i:i + 1], torch.tensor([key]), torch.tensor([i]), 1.0, 0.95) for i in range(n)]
        rollouts.append((logits, torch.tensor([int(t) for t, _ in pairs]),
                         torch.tensor([float(lp) for _, lp in pairs]), key))
    logits2, tokens2, lps2, key2 = rollouts[2]
    edited = tokens2.clone()
    edited[6] = (edited[6] + 1) % 50
    rollouts[2] = (logits2, edited, lps2, key2)
    logits_all, tokens_all, lps_all, keys_all = (list(x) for x in zip(*rollouts))
    together = check_sampling_many(logits_all, tokens_all, lps_all, keys_all, 1.0, 0.95)
    alone = [check_sampling(*r, 1.0, 0.95) for r in rollouts]
    assert together == alone
    assert [c.max_gap > 1e-3 for c in together] == [False, False, True, False]
    assert together[2].worst_position == 6
    assert check_sampling_many([], [], [], [], 1.0, 1.0) == []
