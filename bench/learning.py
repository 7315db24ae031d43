#!/usr/bin/env python
"""Learning benchmark: wall time for the swarm to lift the sampled pass rate of the embedded model to a
target (default 0.60), and in the same run TRL's GRPOTrainer on the same model, task and hyperparameters.

Swarm: trainer, validator and ``--workers`` workers (default 1) as real ``intellect-node join --role ...``
processes on 127.0.0.1, launched together (every rollout verified: proofs, logprobs, sampler, reward). One
worker is the layout that fits this 2-core machine: it makes a step's 8 groups in 0.04 CPU-seconds, and
each further process adds its libp2p, gossip and HTTP overhead to the same two cores (``--workers 2``
measures that). The pass rate is that of the
rollouts the trainer trains on (temperature 1), averaged over the last ``--window`` steps. Also reported:
the trainer's idle fraction (time waiting for accepted work / wall time) and rollout staleness (versions
between the policy a rollout was sampled from and the weights it updates).

TRL (the reference): GRPOTrainer with the settings that make it a plain GRPO loop comparable to ours
(notes: bf16 off, constant LR, AdamW, dr_grpo loss, beta 0, CPU, no vLLM; advantages not divided by the
group std, like ours), the same group size, prompts per
step, learning rate, clipping (eps 0.2 both sides, delta 4), gradient-norm clip and completion length.
Its pass rate is the mean reward TRL logs per step, averaged the same way.

Where a swarm step's time goes: the trainer's ``metrics.jsonl`` (each batch's hops at the trainer, the
step's taken/trained times, publications), the validator's and workers' ``hops.jsonl`` are joined by
batch CID and policy version into the median time of each hop from a worker's batch to the next policy
it generates with (:func:`hop_breakdown`).

Clocks stop at the first step whose windowed pass rate reaches the target (each timed by its own record).
The swarm's starts when its processes are launched, so it includes their imports (torch, libp2p), the joins
and the first policy fetch; TRL runs in a child process and is timed both from that process's launch
(imports of torch, transformers, trl and datasets included: the like-for-like figure) and from its trainer's
construction (the figure earlier runs reported). Run:

    .venv/bin/python bench/learning.py [--target 0.6] [--timeout 900] [--only swarm|trl] [--workers 1]

Needs ``pip install -e '.[bench]'`` for TRL. One thread per process (torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from intellect_node.fsutil import read_jsonl  # noqa: E402  (after the path: runs from a checkout)

HYPER = dict(group_size=8, problems_per_batch=4, groups_per_step=8, max_new_tokens=5, lr=2e-4,
             batches_per_version=1, work_ahead=2)
"""The learning settings are TRL's below; ``batches_per_version`` and ``work_ahead`` are the swarm's
pipeline: the workers at one batch each per version (``problems_per_batch`` is set to ``groups_per_step /
--workers``: 8 groups for one worker, 4 each for two) make exactly the groups a step takes, and
``work_ahead`` 2 has them make (and the validator verify) the batches of step k+2 while the trainer runs
step k, up to two versions stale (``run.async_level`` 2, as INTELLECT-2). With ``batches_per_version`` 2 and
no work-ahead (before) they made 16 groups a version and about a third of all generation and verification
went into batches the trainer never used; with 1 and no work-ahead the swarm ran in series, each step
waiting for rollouts of the version it had just published."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far, all its threads (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def windowed(values: list[float], window: int) -> float:
    tail = values[-window:]
    return sum(tail) / len(tail) if tail else 0.0


def first_reaching(rates: list[float], window: int, target: float) -> int | None:
    """Index of the first step whose mean pass rate over the last ``window`` steps reaches ``target``."""
    for i in range(window - 1, len(rates)):
        if windowed(rates[:i + 1], window) >= target:
            return i
    return None


def held_out_pass_rates(trainer_dir: Path) -> tuple[float, float | None]:
    """Sampled pass rate on 512 fixed problems (inference/evaluate.py) of the embedded model and of the
    trainer's newest published policy (its checkpoint may be up to ``rl.checkpoint_every`` steps older):
    the low-noise before/after of a run."""
    from intellect_node.inference.evaluate import pass_rate, with_weights
    from intellect_node.models.loader import load_model
    from intellect_node.trainer.checkpoint import latest_weights_path

    base = load_model(None)
    published = sorted((trainer_dir / "policy").glob("v*.safetensors"))
    last = published[-1] if published else latest_weights_path(trainer_dir / "checkpoints")
    return pass_rate(base), (pass_rate(with_weights(base, last)) if last is not None else None)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)  # a line torn by the kill at the end is skipped


def _median(xs: list[float | None]) -> float | None:
    known = sorted(x for x in xs if x is not None)
    return known[len(known) // 2] if known else None


def hop_breakdown(work: Path, workers: list[str]) -> dict[str, float | None]:
    """Median seconds of each hop between a worker's batch and the policy trained on it, over the run's
    trained steps. Wall clocks of processes on one machine, so differences across processes are exact."""
    metrics = [m for m in _jsonl(work / "trainer" / "trainer" / "metrics.jsonl") if m.get("trained")]
    verdicts = {v["cid"]: v for v in _jsonl(work / "validator" / "validator" / "hops.jsonl")}
    submitted: dict[str, float] = {}
    heard: dict[int, list[float]] = {}
    loaded: dict[int, list[dict[str, Any]]] = {}
    for w in workers:
        for h in _jsonl(work / w / "worker" / "hops.jsonl"):
            if h["event"] == "submitted":
                submitted[h["cid"]] = h["t"]
            elif h["event"] == "announced":
                heard.setdefault(h["version"], []).append(h["t"])
            elif h["event"] == "loaded":
                loaded.setdefault(h["version"], []).append(h)
    published = {m["published"]["version"]: m["published"] for m in metrics if m.get("published")}
    hops: dict[str, list[float | None]] = {k: [] for k in (
        "submit->validator notice", "validator fetch", "validator verify", "verdict gossip to trainer",
        "trainer prefetch (notice->fetched)", "trainer verdict->admitted", "queued at trainer",
        "train step", "publish", "announcement gossip to workers", "worker fetch+apply+engine",
        "worker fetch", "worker apply (delta+hash)", "worker persist", "batch submit->trained")}
    for m in metrics:
        for cid, h in m.get("hops", {}).items():
            v = verdicts.get(cid, {})
            sub = submitted.get(cid)
            if sub is not None and v.get("notice"):
                hops["submit->validator notice"].append(v["notice"] - sub)
            if v.get("notice") and v.get("fetched"):
                hops["validator fetch"].append(v["fetched"] - v["notice"])
            if v.get("fetched"):
                hops["validator verify"].append(v["verdict"] - v["fetched"])
            if v.get("verdict") and h.get("verdict"):
                hops["verdict gossip to trainer"].append(h["verdict"] - v["verdict"])
            if h.get("notice") and h.get("prefetched"):
                hops["trainer prefetch (notice->fetched)"].append(h["prefetched"] - h["notice"])
            if h.get("verdict") and h.get("admitted"):
                hops["trainer verdict->admitted"].append(h["admitted"] - h["verdict"])
            if h.get("admitted") and m.get("taken_t"):
                hops["queued at trainer"].append(m["taken_t"] - h["admitted"])
            if sub is not None and m.get("trained_t"):
                hops["batch submit->trained"].append(m["trained_t"] - sub)
        if m.get("taken_t") and m.get("trained_t"):
            hops["train step"].append(m["trained_t"] - m["taken_t"])
        pub = published.get(m["version"])
        if pub and m.get("trained_t"):
            hops["publish"].append(pub["time"] - m["trained_t"])
            for t in heard.get(m["version"], []):
                hops["announcement gossip to workers"].append(t - pub["time"])
        for t_heard, ld in zip(sorted(heard.get(m["version"], [])), loaded.get(m["version"], [])):
            hops["worker fetch+apply+engine"].append(ld["t"] - t_heard)
            hops["worker fetch"].append(ld.get("fetch_s"))
            hops["worker apply (delta+hash)"].append(ld.get("apply_s"))
            hops["worker persist"].append(ld.get("persist_s"))
    return {k: _median(v) for k, v in hops.items()}


def startup_timeline(work: Path, workers: list[str], t0_wall: float, trainer_ready: float) -> dict[str, Any]:
    """Seconds from launch to each start-up milestone: the trainer ready (every process is launched at once),
    the first policy loaded by a worker, its first batch submitted, the validator's first verdict."""
    loaded, submitted = [], []
    for w in workers:
        hops = _jsonl(work / w / "worker" / "hops.jsonl")
        loaded += [h["t"] for h in hops if h["event"] == "loaded"][:1]
        submitted += [h["t"] for h in hops if h["event"] == "submitted"][:1]
    verdicts = [v["verdict"] for v in _jsonl(work / "validator" / "validator" / "hops.jsonl")
                if v.get("verdict")]
    return {"trainer_ready": trainer_ready,
            "first_policy_loaded": min(loaded) - t0_wall if loaded else None,
            "first_batch_submitted": min(submitted) - t0_wall if submitted else None,
            "first_verdict": min(verdicts) - t0_wall if verdicts else None}


def start_node(data_dir: Path, role: str, procs: list[Any], *, ids: dict[str, str], model: str,
               bootstrap: list[str] | None = None, port: int = 0, rl: dict[str, Any] | None = None,
               run_extra: dict[str, Any] | None = None) -> Any:
    """``intellect-node join --role ROLE`` with ``data_dir/config.toml`` (the run: trainer, validator,
    model, ``run_extra``; ``rl`` or HYPER), started through the node's process supervisor and added to
    ``procs``."""
    from intellect_node.node.processes import NodeProcess, child_env, write_config

    network: dict[str, Any] = {"listen": [f"/ip4/127.0.0.1/tcp/{port}"], "http_host": "127.0.0.1",
                               "heartbeat_interval": 1.0, "peer_timeout": 10.0}
    if bootstrap:
        network["bootstrap"] = bootstrap
    run = {"run_id": "e2e", "trainer_peer_id": ids["trainer"], "validator_peer_ids": [ids["validator"]],
           "model": model, "async_level": 2, "verdict_quorum": 1, "worker_allowlist": [], **(run_extra or {})}
    write_config(data_dir / "config.toml", {"network": network, "metrics": {"enabled": False}, "run": run,
                                            "rl": HYPER if rl is None else rl, "validator": {}})
    proc = NodeProcess.join(data_dir, "--role", role, output=data_dir.parent / f"{data_dir.name}.log",
                            env=child_env({"PYTHONPATH": str(REPO)}), cwd=REPO)
    procs.append(proc)
    return proc


@dataclass(frozen=True)
class Swarm:
    """A launched swarm: its trainer's process, the node names (data dirs under the work dir) and the
    clocks at launch."""

    trainer: Any
    names: list[str]
    """trainer, validator, then the workers."""
    workers: list[str]
    t0: float
    """``time.monotonic()`` at launch."""
    t0_wall: float


def launch_swarm(workdir: Path, procs: list[Any], *, model: str, workers: int = 1, nice: int = 0,
                 rl: dict[str, Any] | None = None, run_extra: dict[str, Any] | None = None,
                 key_seed: str | None = None) -> Swarm:
    """Start a trainer, a validator and ``workers`` workers under ``workdir`` (keys, configs, logs), all
    at once, as a swarm's operators would start them: the trainer on a port chosen beforehand, so the
    others can name it as their bootstrap peer before it is up (they dial it again until it answers) and
    import torch while it loads its model. Every process is added to ``procs`` as it starts (the caller
    kills them). With ``key_seed`` the node keys are derived from it (SHA-256 of ``<key_seed>/<name>``), so
    two launches with one seed have the same peer IDs, hence the same problem assignments and sampling
    seeds (``envs/assignment.py``, ``proofs/sampling.py``); without, fresh random keys."""
    from intellect_node.p2p.identity import store_key
    from intellect_node.p2p.ports import free_tcp_port
    from intellect_node.protocol.signing import SigningKey

    ids = {}
    wnames = [f"w{i + 1}" for i in range(workers)]
    names = ["trainer", "validator", *wnames]
    for n in names:
        (workdir / n).mkdir(parents=True, exist_ok=True)
        key = (SigningKey.generate() if key_seed is None
               else SigningKey(hashlib.sha256(f"{key_seed}/{n}".encode()).digest()))
        ids[n] = store_key(workdir / n, key).peer_id
    common: dict[str, Any] = dict(ids=ids, model=model, rl=rl, run_extra=run_extra)
    t0, t0_wall = time.monotonic(), time.time()
    port = free_tcp_port()
    trainer = start_node(workdir / "trainer", "trainer", procs, port=port, **common)
    t_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ids['trainer']}"
    for n, role in (("validator", "validator"), *((w, "worker") for w in wnames)):
        proc = start_node(workdir / n, role, procs, bootstrap=[t_addr], **common)
        if nice:  # the roles that work ahead yield the CPU to the trainer, the one serial stage
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    return Swarm(trainer, names, wnames, t0, t0_wall)


def run_swarm(target: float, window: int, timeout: float, workdir: Path, workers: int = 1,
              nice: int = 0) -> dict[str, Any]:
    from intellect_node.models.loader import embedded_model_dir

    procs: list[Any] = []
    try:
        swarm = launch_swarm(workdir, procs, model=str(embedded_model_dir()), workers=workers, nice=nice)
        trainer, names, wnames, t0, t0_wall = (swarm.trainer, swarm.names, swarm.workers, swarm.t0,
                                               swarm.t0_wall)
        trainer.wait_ready(300)
        trainer_ready = time.time() - t0_wall
        metrics_path = workdir / "trainer" / "trainer" / "metrics.jsonl"
        reached, hit = None, None
        cpu_first: tuple[int, list[float]] | None = None  # (trained steps, CPU seconds) at the first look
        while time.monotonic() - t0 < timeout:
            time.sleep(1.0)
            lines = ([json.loads(x) for x in metrics_path.read_text().splitlines()]
                     if metrics_path.exists() else [])
            trained = [m for m in lines if m["trained"]]
            if trained and cpu_first is None:
                cpu_first = (len(trained), [cpu_seconds(p.pid) for p in procs])
            hit = first_reaching([m["pass_rate"] for m in trained], window, target)
            if hit is not None:  # timed by the step's own record, not by this poll
                reached = trained[hit]["time"] - t0_wall
                break
        status = trainer.status()["trainer"]
        lines = [json.loads(x) for x in metrics_path.read_text().splitlines()]
        n_end = len([m for m in lines if m["trained"]])
        cpu_end = [cpu_seconds(p.pid) for p in procs]
    finally:
        for p in procs:
            p.kill()
    held_out = held_out_pass_rates(workdir / "trainer" / "trainer")
    hops = hop_breakdown(workdir, wnames)
    trained = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    trained = [m for m in trained if m["trained"]]
    first_step_t = trained[0]["time"] if trained else None
    return {"seconds_to_target": reached, "steps": len(trained),
            "steps_to_target": hit + 1 if hit is not None else None,
            "start_pass_rate": windowed([m["pass_rate"] for m in trained[:window]], window),
            "final_pass_rate": windowed([m["pass_rate"] for m in trained], window),
            "held_out_start": held_out[0], "held_out_final": held_out[1],
            "idle_fraction": status.get("idle_fraction"),
            "staleness_mean": sum(m["staleness_mean"] for m in trained) / max(len(trained), 1),
            "staleness_max": max((m["staleness_max"] for m in trained), default=0),
            "seconds_per_step": ((trained[-1]["time"] - first_step_t) / max(len(trained) - 1, 1)
                                 if first_step_t else None),
            # launch -> first trained step: imports, joins, the first policy, the first batches verified
            "seconds_to_first_step": first_step_t - t0_wall if first_step_t else None,
            "startup": startup_timeline(workdir, wnames, t0_wall, trainer_ready),
            "step_medians": {k: _median([m.get(k) for m in trained]) for k in
                             ("train_s", "publish_wait_s", "checkpoint_s", "publish_s")},
            "verified": status.get("accepted_rollouts"), "hops": hops,
            "batches": {k: status.get(k) for k in ("accepted_batches", "stale_batches", "rejected_batches",
                                                   "duplicate_batches")},
            "prefetch": status.get("prefetch"),
            # CPU seconds each process spent per trained step while training ran: the work a step costs
            # the machine, whatever the pipeline overlaps
            "cpu_s_per_step": ({n: (b - a) / max(n_end - cpu_first[0], 1)
                                for n, a, b in zip(names, cpu_first[1], cpu_end)} if cpu_first else None)}


def work_floor(repeats: int = 15) -> dict[str, float]:
    """CPU seconds of the swarm's own work for one step, each part alone in this process (one thread,
    median of ``repeats``): the workers' generation of the step's rollouts with proofs (in batches of
    ``problems_per_batch`` groups, as the workers make them), the validator's verification of all of them,
    and the trainer's optimizer step on them. What is left of the swarm's CPU per step is the overhead of
    its processes (libp2p, gossip, HTTP, policy deltas, persistence)."""
    import random

    import torch

    from bench.rollouts import median_time
    from intellect_node.envs.tasks import embedded_task
    from intellect_node.inference.base import SamplingConfig
    from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.inference.verifier import Expectations, Verifier
    from intellect_node.proofs.thresholds import Thresholds
    from intellect_node.protocol.signing import SigningKey
    from intellect_node.roles.common.records import record_to_sample
    from intellect_node.trainer.grpo import GRPOConfig
    from intellect_node.trainer.model import load_trainable
    from intellect_node.trainer.step import make_optimizer, train_step

    torch.set_num_threads(1)
    h = HYPER
    engine = TorchEngine.from_dir(None)
    task, key, ckpt = embedded_task(), SigningKey(bytes(32)), checkpoint_cid(engine.loaded.path)
    sampling = SamplingConfig(max_new_tokens=int(h["max_new_tokens"]))
    batches = int(h["groups_per_step"]) // int(h["problems_per_batch"])
    rng = random.Random(0)

    def generate() -> list[Any]:
        out = []
        for _ in range(batches):
            drawn = task.sample(rng, int(h["problems_per_batch"]))
            problems = [p for p in drawn for _ in range(int(h["group_size"]))]
            seed = rng.randrange(1 << 30)
            out += generate_rollouts(engine, engine.loaded.tokenizer, problems, key=key, run_id="floor",
                                     policy_version=0, checkpoint=ckpt, sampling=sampling,
                                     seeds=[seed + i for i in range(len(problems))])
        return out

    def timed(fn: Any) -> float:
        fn()  # warm-up
        return median_time(fn, repeats)

    records = generate()
    # loose thresholds: the figures are timed here, not judged
    verifier = Verifier(engine, Thresholds(exp_mismatches=1 << 20, mant_err_mean=1e9, mant_err_median=1e9,
                                           logprob_diff=1e9, sampling_gap=1e9), Expectations())
    model = load_trainable(None)
    opt = make_optimizer(model, float(h["lr"]))
    cfg = GRPOConfig(group_size=int(h["group_size"]), max_grad_norm=0.1)
    samples = [record_to_sample(r, float(i % 3 == 0)) for i, r in enumerate(records)]
    out = {"generate": timed(generate),
           "verify": timed(lambda: [verifier.verify(records[i:i + 32]) for i in range(0, len(records), 32)]),
           "train": timed(lambda: train_step(model, opt, samples, cfg))}
    out["total"] = sum(out.values())
    return out


def run_trl_child(target: float, window: int, timeout: float, workdir: Path) -> dict[str, Any]:
    """:func:`run_trl` in a fresh process (``--trl-child``), timed from its launch: a TRL user pays the
    imports as the swarm's processes do."""
    import subprocess

    out = workdir / "trl.json"
    launched = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    subprocess.run([sys.executable, __file__, "--only", "trl", "--trl-child", str(launched), "--target",
                    str(target), "--window", str(window), "--timeout", str(timeout), "--out", str(out)],
                   check=True, cwd=REPO)
    return dict(json.loads(out.read_text())["trl"])


def trl_config(h: dict[str, Any], output_dir: Path, max_steps: int = 100000, seed: int = 0) -> Any:
    """TRL's ``GRPOConfig`` for the settings ``h`` (``HYPER``'s keys; ``temperature`` and
    ``max_grad_norm`` where given): a plain GRPO loop as the swarm's trainer runs it (one optimizer step
    per generation batch of ``groups_per_step`` groups, constant LR, AdamW, token sums over a constant
    budget (``dr_grpo``), no KL, advantages not divided by the group std, PPO clipping 0.2 both sides
    with the unclipped ratio capped at 4, fp32 on the CPU); ``seed`` seeds its sampling (torch)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir), learning_rate=h["lr"], lr_scheduler_type="constant",
        optim="adamw_torch", per_device_train_batch_size=h["groups_per_step"] * h["group_size"],
        num_generations=h["group_size"], max_completion_length=h["max_new_tokens"],
        temperature=float(h.get("temperature", 1.0)),
        beta=0.0, loss_type="dr_grpo", scale_rewards="none", epsilon=0.2, epsilon_high=0.2, delta=4.0,
        max_grad_norm=float(h.get("max_grad_norm", 0.1)),
        bf16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False, shuffle_dataset=False,
        report_to="none", save_strategy="no", logging_steps=1, max_steps=max_steps, seed=seed)


def run_trl(target: float, window: int, timeout: float, workdir: Path,
            launched: float | None = None) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from intellect_node.envs.tasks import embedded_task
    from intellect_node.models.loader import BOS, embedded_model_dir, load_hf_model

    torch.set_num_threads(1)
    mdir = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(str(mdir))
    task = embedded_task()
    import random

    problems = task.sample(random.Random(0), 20000)
    ds = Dataset.from_list([{"prompt": BOS + p.prompt, "answer": p.answer} for p in problems])

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]

    cfg = trl_config(HYPER, workdir / "trl")
    rewards: list[float] = []
    times: list[float] = []
    cpu: list[float] = []
    t0 = time.monotonic()

    class Stop(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                times.append(time.monotonic() - t0)
                cpu.append(time.process_time())
                if (len(rewards) >= window and windowed(rewards, window) >= target) or \
                        time.monotonic() - t0 > timeout:
                    control.should_training_stop = True

    trainer = GRPOTrainer(model=load_hf_model(mdir), reward_funcs=[reward], args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Stop()])
    trainer.train()
    import dataclasses

    from intellect_node.inference.evaluate import pass_rate
    from intellect_node.models.loader import load_model

    base = load_model(None)
    final = {k: v.detach().to(torch.float32).clone() for k, v in trainer.model.state_dict().items()}
    held_out = (pass_rate(base),
                pass_rate(dataclasses.replace(base, state={k: final[k] for k in base.state})))
    reached = times[-1] if rewards and windowed(rewards, window) >= target else None
    from_launch = t0 - launched if launched is not None else None  # imports, dataset, up to t0
    return {"seconds_to_target": reached, "steps": len(rewards),
            "steps_to_target": len(rewards) if reached is not None else None,  # it stops on reaching
            "seconds_launch_to_trainer": from_launch,
            "seconds_to_target_from_launch": (reached + from_launch if reached is not None and
                                              from_launch is not None else None),
            "start_pass_rate": windowed(rewards[:window], window),
            "final_pass_rate": windowed(rewards, window),
            "held_out_start": held_out[0], "held_out_final": held_out[1],
            "seconds_per_step": (times[-1] - times[0]) / max(len(times) - 1, 1) if times else None,
            "cpu_s_per_step": (cpu[-1] - cpu[0]) / max(len(cpu) - 1, 1) if cpu else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.60)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per system before giving up")
    ap.add_argument("--only", choices=["swarm", "trl"])
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of the validator and worker processes (the trainer's stays 0)")
    ap.add_argument("--workers", type=int, choices=[1, 2, 4, 8], default=1,
                    help="worker processes in the swarm; each makes groups_per_step/workers groups a version")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "learning.json")
    ap.add_argument("--trl-child", type=float, default=None, help=argparse.SUPPRESS)  # the parent's launch
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    HYPER["problems_per_batch"] = int(HYPER["groups_per_step"]) // args.workers  # one step a version
    results: dict[str, Any] = {"target": args.target, "window": args.window, "hyper": HYPER,
                               "workers": args.workers, "nice": args.nice}
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        work = Path(tmp)
        if args.only in (None, "swarm"):
            results["swarm"] = run_swarm(args.target, args.window, args.timeout, work / "swarm",
                                         args.workers, args.nice)
            print("swarm:", json.dumps(results["swarm"]), flush=True)
        if args.only is None:
            results["work_floor"] = work_floor()
            print("work floor:", json.dumps(results["work_floor"]), flush=True)
        if args.trl_child is not None:
            results["trl"] = run_trl(args.target, args.window, args.timeout, work, args.trl_child)
        elif args.only in (None, "trl"):
            results["trl"] = run_trl_child(args.target, args.window, args.timeout, work)
            print("trl:  ", json.dumps(results["trl"]), flush=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.trl_child is not None:
        args.out.write_text(json.dumps(results))
        return
    s, t = results.get("swarm", {}), results.get("trl", {})
    if s.get("seconds_to_target") and t.get("seconds_to_target_from_launch"):
        print(f"time to pass rate {args.target:.2f} from launch: swarm {s['seconds_to_target']:.1f} s "
              f"(first step at {s['seconds_to_first_step']:.1f} s), TRL "
              f"{t['seconds_to_target_from_launch']:.1f} s (its trainer built at "
              f"{t['seconds_launch_to_trainer']:.1f} s), ratio swarm/TRL "
              f"{s['seconds_to_target'] / t['seconds_to_target_from_launch']:.2f}")
    if s.get("seconds_to_target") and t.get("seconds_to_target"):
        print(f"time to pass rate {args.target:.2f}, TRL from its trainer's construction: swarm "
              f"{s['seconds_to_target']:.1f} s, TRL {t['seconds_to_target']:.1f} s, ratio swarm/TRL "
              f"{s['seconds_to_target'] / t['seconds_to_target']:.2f}")
    if s.get("steps_to_target") and t.get("steps_to_target"):
        print(f"steps to pass rate {args.target:.2f}: swarm {s['steps_to_target']}, "
              f"TRL {t['steps_to_target']}")
    if s.get("seconds_per_step") and t.get("seconds_per_step"):
        print(f"seconds per step: swarm {s['seconds_per_step']:.2f}, TRL {t['seconds_per_step']:.2f}, ratio "
              f"{s['seconds_per_step'] / t['seconds_per_step']:.2f}")
    if s.get("hops"):
        print("swarm per-hop medians (s):")
        for k, v in s["hops"].items():
            print(f"  {k:40s} {'-' if v is None else f'{v:.3f}'}")
        print("swarm step medians (s):", json.dumps(s["step_medians"]))
    if s.get("cpu_s_per_step") and t.get("cpu_s_per_step"):
        total = sum(s["cpu_s_per_step"].values())
        print(f"CPU seconds per step: swarm {total:.2f} ("
              + ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_s_per_step"].items())
              + f"), TRL {t['cpu_s_per_step']:.2f}, ratio {total / t['cpu_s_per_step']:.2f}; on "
              f"{os.cpu_count()} cores the swarm's floor is {total / (os.cpu_count() or 1):.2f} s/step")
    f = results.get("work_floor")
    if f and t.get("seconds_per_step"):
        ratio = f["total"] / t["seconds_per_step"]
        print(f"the swarm's own work per step, each part alone (CPU s): generate {f['generate']:.3f} + "
              f"verify {f['verify']:.3f} + train {f['train']:.3f} = {f['total']:.3f}, {ratio:.2f}x TRL's "
              "whole step; its overhead is the rest of the CPU per step above")
    if s:
        print(f"swarm trainer idle fraction {s['idle_fraction']}, staleness mean {s['staleness_mean']:.2f} "
              f"max {s['staleness_max']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
