#!/usr/bin/env python
"""The ``rl.loss`` variants and the target-KL step on one-step-stale batches, each beside ``grpo`` in the
same run, as ratios.

In one process on the embedded model, no network: the trainer's step (``trainer/step.py``) fed by the
real engine (the workers' seeded sampler). Every arm trains ``--steps`` steps of ``--problems`` problems x
``--group`` completions; the batch of step k is sampled by the policy of version k - 1 (one version
stale, what ``rl.work_ahead`` 1 gives the trainer), so the trainer's weights have moved one step past the
sampler's. Per arm and seed it measures, each step, KL(sampler || current) per token, the fraction of
tokens the objective cut (clipped, masked or truncated), the largest ratio and the training pass rate;
at the end, the sampled pass rate on ``--held-out`` problems drawn apart from training (fixed sampler
keys, the same for every arm). Arms share seeds, so each arm's figure is divided by ``grpo``'s of the
same seeds. Run (a couple of minutes a seed on 2 cores):

    .venv/bin/python bench/loss_variants.py [--steps 30] [--seeds 2] [--lr 2e-4] [--target-kl 0.01]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from intellect_node.envs.tasks import embedded_task  # noqa: E402
from intellect_node.inference.base import SamplingConfig  # noqa: E402
from intellect_node.inference.torch_engine import TorchEngine  # noqa: E402
from intellect_node.models.loader import load_hf_model, load_model  # noqa: E402
from intellect_node.trainer.grpo import GRPOConfig  # noqa: E402
from intellect_node.trainer.step import Sample, make_optimizer, train_step  # noqa: E402
from intellect_node.trainer.stepsize import next_scale, step_lr  # noqa: E402

ARMS = ("grpo", "intellect2", "prime", "mis", "grpo+target_kl")


def _engine(base: Any, model: Any) -> TorchEngine:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TorchEngine(dataclasses.replace(base, state=state))


def _pass_rate(engine: TorchEngine, tok: Any, problems: list[Any], seed: int, tokens: int) -> float:
    rng = random.Random(seed)
    gens = engine.generate([tok.prompt_ids(p.prompt) for p in problems],
                           [rng.getrandbits(62) for _ in problems], SamplingConfig(1.0, 1.0, tokens))
    rewards: list[float] = [p.reward(tok.decode(g.tokens)) for p, g in zip(problems, gens)]
    return sum(rewards) / len(problems)


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    base = load_model(None)
    tok = base.tokenizer
    model = load_hf_model(None)
    model.train(False)  # eval mode (transformers leaves eval() untyped)
    task = embedded_task()
    held_out = task.sample(random.Random(10_000 + seed), args.held_out)
    loss = arm.split("+")[0]
    target = args.target_kl if arm.endswith("+target_kl") else None
    cfg = GRPOConfig(group_size=args.group, token_budget=args.group * args.problems * args.tokens,
                     max_grad_norm=0.1, loss=loss)
    opt = make_optimizer(model, args.lr)
    rng = random.Random(seed)
    sampler = _engine(base, model)  # version 0 samples steps 0 and 1; then one version behind
    scale, steps = 1.0, []
    t0 = time.monotonic()
    for k in range(args.steps):
        current = _engine(base, model)
        problems = [p for p in task.sample(rng, args.problems) for _ in range(args.group)]
        keys = [rng.getrandbits(62) for _ in problems]
        gens = sampler.generate([tok.prompt_ids(p.prompt) for p in problems], keys,
                                SamplingConfig(1.0, 1.0, args.tokens))
        samples = [Sample(tuple(g.prompt_tokens), tuple(g.tokens), tuple(g.logprobs),
                          p.reward(tok.decode(g.tokens)), policy_version=max(k - 1, 0))
                   for p, g in zip(problems, gens)]
        lr = step_lr(args.lr, k, 0, scale)
        st = train_step(model, opt, samples, cfg, lr=lr)
        if k >= 1:  # from step 1 on the batch is one version stale: the controller measures it
            scale = next_scale(scale, st.kl_sampler, target)
        sampler = current
        steps.append({"kl": st.kl_sampler, "cut": st.clipped_frac, "ratio_max": st.ratio_max,
                      "pass": st.reward_mean, "lr": st.lr, "grad_norm": st.grad_norm})
    model.train(False)  # eval mode (transformers leaves eval() untyped)
    held = _pass_rate(_engine(base, model), tok, held_out, seed=1, tokens=args.tokens)
    stale = steps[1:]

    def mean(key: str, rows: list[dict[str, float]]) -> float:
        return sum(r[key] for r in rows) / max(len(rows), 1)

    tail = steps[-max(1, args.steps // 3):]
    return {"arm": arm, "seed": seed, "kl": mean("kl", stale), "cut": mean("cut", stale),
            "ratio_max": max(r["ratio_max"] for r in stale), "train_pass_last": mean("pass", tail),
            "held_out_pass": held, "lr_last": steps[-1]["lr"], "seconds": time.monotonic() - t0,
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--target-kl", type=float, default=0.01)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--held-out", type=int, default=512)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--json", type=Path, help="write every arm's per-step figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    arms = args.arms.split(",")
    if arms[0] != "grpo":
        arms = ["grpo", *[a for a in arms if a != "grpo"]]  # the baseline first
    results = [run_arm(a, s, args) for s in range(args.seeds) for a in arms]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"embedded model, lr {args.lr:g}, {args.steps} steps of {args.problems}x{args.group}, one version "
          f"stale, {args.seeds} seed(s); means over seeds (KL and cut: per token, steps 1..; pass: held-out "
          f"{args.held_out} problems, last third of training)")
    print(f"{'arm':>16} {'KL/token':>10} {'cut':>7} {'ratio max':>9} {'train pass':>10} {'held-out':>9} "
          f"{'lr last':>8}   vs grpo: KL, cut, held-out")
    by_arm = {a: [r for r in results if r["arm"] == a] for a in arms}

    def avg(a: str, key: str) -> float:
        values: list[float] = [r[key] for r in by_arm[a]]
        return sum(values) / len(by_arm[a])

    for a in arms:
        ratios = ", ".join(f"{avg(a, k) / avg('grpo', k):.2f}x" if avg("grpo", k) else "-"
                           for k in ("kl", "cut", "held_out_pass"))
        print(f"{a:>16} {avg(a, 'kl'):10.4f} {avg(a, 'cut'):7.1%} {avg(a, 'ratio_max'):9.2f} "
              f"{avg(a, 'train_pass_last'):10.3f} {avg(a, 'held_out_pass'):9.3f} {avg(a, 'lr_last'):8.2g}   "
              f"{ratios}")
    spread = {a: [round(r["held_out_pass"], 3) for r in by_arm[a]] for a in arms}
    print(f"held-out pass by seed: {spread}")


if __name__ == "__main__":
    main()
