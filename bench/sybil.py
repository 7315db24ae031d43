#!/usr/bin/env python
"""What one attacker with one key, and with 100, can still cost an honest run, beside an honest worker.

    .venv/bin/python bench/sybil.py [--group-size 16] [--problems 4] [--new-tokens 8] [--fraction 0.25]
                                    [--repeats 5] [--keys 100]

About three minutes on two cores. Part 1 measures the parts; part 2 prints one table, an attack a row
pair (1 key, ``--keys`` keys): the validator's CPU, how much later an honest worker's verdict comes, the
trainer's CPU, memory and disk, and what it did to honest peers (for the attacks on the run's own rules,
``sybil_runs.py``: replayed gossip in a running, audited run, framing by a validator outside the quorum,
one auditor's failure, unjudged batches re-sent, new peers after bans). Rows marked "driven" run the
attack against the real component (the trainer's prefetch and blob fetch over HTTP on 127.0.0.1, the
validator's intake, the scoring sandbox, the roles in one process, libp2p on 127.0.0.1); "model" rows
combine part 1's measurements with the run's defaults, by the rule the row names.

Measured on the embedded model (one thread, CPU time via ``time.process_time``, median of ``--repeats``):

- an honest batch: the worker's cost to generate it, the validator's to verify it in full, on
  ``--fraction``'s sample of groups, and with the cheap checks only;
- a forged batch (one group generated with other weights, the other groups honest: the forgery that
  sampling misses most often) verified in full and sampled: is it caught, and at what cost;
- the intake's cost per notice (gossip decode + signature + budget check), what flooding buys.

Then the arithmetic with the run's defaults (``rl.ban_after``, ``rl.verify_first_batches``,
``validator.*``): what one fresh key and a stream of them cost the validator, with and without the
first-K rule, side by side with the honest baseline. bench/README.md ("sybil") records a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import sybil_attacks  # noqa: E402
from intellect_node.config import NodeConfig  # noqa: E402
from intellect_node.envs.tasks import embedded_task  # noqa: E402
from intellect_node.inference.base import SamplingConfig  # noqa: E402
from intellect_node.inference.rollouts import generate_rollouts  # noqa: E402
from intellect_node.inference.torch_engine import TorchEngine  # noqa: E402
from intellect_node.inference.verifier import Expectations, Verdict, Verifier  # noqa: E402
from intellect_node.models.loader import embedded_model_dir, load_model  # noqa: E402
from intellect_node.proofs.thresholds import load_thresholds  # noqa: E402
from intellect_node.protocol.ids import cid_of  # noqa: E402
from intellect_node.protocol.rl import RolloutNotice, notice_validator, seal_notice  # noqa: E402
from intellect_node.protocol.rollout import MAX_BATCH_SIZE, RolloutBatch, encode_batch  # noqa: E402
from intellect_node.protocol.signing import SigningKey  # noqa: E402
from intellect_node.roles.validator.intake import Intake, Limits  # noqa: E402

RUN = "bench"


def cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median CPU seconds of ``fn`` over ``repeats`` runs, and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), out


def sampled(verifier: Verifier, recs: list[Any], group: int, k: int, rng: random.Random) -> list[Any]:
    """What the validator runs under verify_fraction: tensor checks on k random groups, cheap on the rest."""
    groups = [list(range(s, s + group)) for s in range(0, len(recs), group)]
    full = {i for g in rng.sample(groups, k) for i in g}
    out: list[Verdict | None] = list(verifier.verify([recs[i] for i in sorted(full)]))
    for i, r in enumerate(recs):
        if i not in full:
            out.append(verifier._cheap(r))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--keys", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = NodeConfig()
    rl, vc = cfg.rl, cfg.validator

    loaded = load_model(None, dtype="float32")
    engine = TorchEngine(loaded)
    g = torch.Generator().manual_seed(1)
    other = TorchEngine(dataclasses.replace(loaded, state={
        k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
        for k, v in loaded.state.items()}))
    thresholds = load_thresholds(embedded_model_dir(), "float32")
    ckpt = cid_of((embedded_model_dir() / "model.safetensors").read_bytes())
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens)
    key = SigningKey.generate()
    task = embedded_task()
    problems = [p for p in task.sample(random.Random(0), args.problems) for _ in range(args.group_size)]
    gs = args.group_size
    n_groups = args.problems
    k = max(1, round(n_groups * args.fraction))

    def gen(eng: TorchEngine, probs: list[Any]) -> list[Any]:
        return generate_rollouts(eng, loaded.tokenizer, probs, key=key, run_id=RUN, policy_version=0,
                                 checkpoint=ckpt, sampling=sampling)

    t_gen, honest = cpu(lambda: gen(engine, problems), args.repeats)
    # The forger: its first group from other weights, the rest honest (same seeds as the run derives).
    forged = gen(other, problems)[:gs] + honest[gs:]
    verifier = Verifier(engine, thresholds,
                        Expectations(run_id=RUN, policy_version=0, checkpoint_cid=ckpt,
                                     temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens))
    rng = random.Random(0)
    t_full, v_full = cpu(lambda: verifier.verify(honest), args.repeats)
    t_frac, _ = cpu(lambda: sampled(verifier, honest, gs, k, rng), args.repeats)
    t_cheap, _ = cpu(lambda: [verifier._cheap(r) for r in honest], args.repeats)
    t_forged_full, fv = cpu(lambda: verifier.verify(forged), args.repeats)
    caught_full = any(not v.accepted for v in fv)
    trials = 200
    caught = sum(any(v is not None and not v.accepted for v in sampled(verifier, forged, gs, k, rng))
                 for _ in range(trials)) / trials
    assert all(v.accepted for v in v_full), "the honest batch must pass"

    # The intake: a signed notice through the gossip check and the budget, per notice.
    raw = seal_notice(key, RolloutNotice(run_id=RUN, batch_cid=ckpt, policy_version=0, n_rollouts=len(honest),
                                         batch_bytes=30_000))
    check = notice_validator(RUN)
    intake = Intake(Limits.from_config(vc, max_batch_bytes=MAX_BATCH_SIZE))
    n = 2000
    t0 = time.process_time()
    for i in range(n):
        notice, signer = check(raw, key.peer_id)
        intake.offer(signer, notice, float(i), 0)
    t_notice = (time.process_time() - t0) / n

    p = k / n_groups  # chance a sampled validator catches a one-group forgery
    K, B = rl.verify_first_batches, rl.ban_after
    new_per_min = vc.new_workers_per_min
    print(f"embedded model, {n_groups} problems x {gs} samples = {len(honest)} rollouts, "
          f"{args.new_tokens} new tokens, verify_fraction {args.fraction} ({k} of {n_groups} groups); "
          f"CPU s, median of {args.repeats}; {os.cpu_count()} cores\n")
    rows = [
        ("worker: generate an honest batch", t_gen, "what an honest batch costs its worker"),
        ("validator: verify it in full", t_full, f"{t_full / t_gen:.2f}x generation"),
        (f"validator: verify it sampled ({k}/{n_groups} groups)", t_frac, f"{t_frac / t_full:.2f}x full"),
        ("validator: cheap checks only", t_cheap, f"{t_cheap / t_full:.2f}x full"),
        ("validator: forged batch in full", t_forged_full, f"caught: {caught_full}"),
        ("validator: forged batch sampled", t_frac, f"caught {caught:.2f} of {trials} (p = {p:.2f})"),
        ("validator: one notice through gossip check + intake", t_notice,
         f"{1 / t_notice:,.0f} a core-second"),
    ]
    for name, secs, note in rows:
        print(f"  {name:<55} {secs:9.4f}  {note}")

    print(f"\nA fresh key forging one group a batch (ban_after {B}, verify_first_batches {K}):")
    # Without the first-K rule: every batch is sampled; it takes B/p batches to collect B rejections,
    # (1-p)/p forged batches get through per rejection.
    no_k_batches = B / p
    print(f"  without first-K: {no_k_batches:.1f} batches until banned, "
          f"validator {no_k_batches * t_frac:.3f} CPU s, "
          f"{no_k_batches * (1 - p):.1f} forged batches accepted (trained on), "
          "attacker cost 0 honest batches")
    print(f"  with first-K:    {B} batches until banned, validator {B * t_full:.3f} CPU s, 0 forged accepted "
          f"unless it first submits {K} honest batches ({K * t_gen:.2f} CPU s of its own generation)")
    print(f"\nMany keys (new_workers_per_min {new_per_min:g}, burst {vc.new_worker_burst}, strikes_ban_after "
          f"{vc.strikes_ban_after}, fetch_timeout_s {vc.fetch_timeout_s:g}, max_jobs {vc.max_jobs}):")
    per_min = new_per_min * B * t_full
    print(f"  forged batches: {new_per_min:g} keys/min x {B} x {t_full:.3f} s = {per_min:.2f} CPU s/min "
          f"({per_min / 60:.1%} of one core); honest baseline: one worker's batch every ~2 s = "
          f"{30 * t_frac:.2f}-{30 * t_full:.2f} CPU s/min")
    print(f"  unbacked notices (tarpits): {vc.strikes_ban_after} x {vc.fetch_timeout_s:g} s "
          f"of one job slot per key, at most {vc.max_jobs} slots for workers without accepted work; "
          f"proven workers have their own {vc.max_jobs}")
    flood_s = 10 * t_notice  # gossipsub forwards at most 10 messages/s per peer and topic
    print(f"  notice flood: at most 10/s per connected peer reach the intake = "
          f"{flood_s * 60:.3f} CPU s/min per key, refused as flood past {vc.peer_notice_burst} + "
          f"{vc.peer_notices_per_min:g}/min")

    parts = sybil_attacks.Parts(gen_s=t_gen, verify_s=t_full, notice_s=t_notice, rollouts=len(honest),
                                batch_bytes=len(encode_batch(RolloutBatch(run_id=RUN, policy_version=0,
                                                                          rollouts=honest))))
    sybil_attacks.report(cfg, parts, keys=args.keys)


if __name__ == "__main__":
    main()
