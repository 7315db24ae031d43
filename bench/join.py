#!/usr/bin/env python
"""Join benchmark: a fresh worker's time to its first accepted batch, and a role-less node's start-up.

Aims: a fresh worker's first accepted batch within 30 s of its process start on the embedded model
(issue #15 part 3); a node with no role started in under 2 s (issue #17).

Join: a running local swarm, a trainer and a validator on the embedded model started the way the demo
starts them (``intellect-node join --role ...`` processes on 127.0.0.1, the demo's RL settings and
network timings; ``--workers N`` adds N workers already at work, so the trainer is stepping), then one
fresh worker: a new data dir, no key (``join`` makes one), bootstrapped to the trainer and validator.
The stages are the worker's own timeline (``snapshot.timeline``, config/status.py), seconds from its
process's start as the kernel records it: ready (control API up), first peer, first policy held, first
batch submitted, first batch accepted. The bench's outside view (spawn to the status poll that first
showed the acceptance, 0.2 s polls) is printed beside it as a cross-check.

With ``--by-cid`` the run is a signed manifest in the trainer's store (``commands/run.seal_run``, what
``run init`` makes) and every node joins with ``join --run CID``; the fresh worker has nothing but the
CID and the bootstrap addresses, so its timeline includes fetching the manifest and the model's files by
their hashes from the trainer before its node starts (issue 33: two commands, ``keys init`` and ``join
--run``, to a first accepted batch).

Start-up: ``intellect-node join --help`` wall time, and a headless node with no role from spawn to its
first ``GET /v1/status`` answer (a fresh data dir each run, so key generation counts), the median of
``--runs``; with the heaviest top-level imports of ``python -X importtime`` (the CLI's and the node's).

Run:

    .venv/bin/python bench/join.py [--only join|startup] [--workers 0] [--runs 5] [--timeout 300] [--by-cid]

One thread per process (OMP_NUM_THREADS=1 in every child; torch.set_num_threads(1) in the nodes).
"""

from __future__ import annotations

import argparse
import json
import os
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

AIM_JOIN_S = 30.0
"""Issue #15: a fresh worker's first accepted batch within 30 s of its start."""
AIM_START_S = 2.0
"""Issue #17: a node starts in under 2 s."""
POLL_S = 0.2


def _env() -> dict[str, str]:
    from intellect_node.node.processes import child_env

    return child_env({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, drop_prefix="INTELLECT_NODE_")


def _run_config(ids: dict[str, str], model: str) -> dict[str, Any]:
    """The demo's run (``commands/demo.py``: its RL settings) as config sections."""
    from intellect_node.commands.demo import DEMO_RL

    return {"run": {"run_id": "bench-join", "trainer_peer_id": ids["trainer"],
                    "validator_peer_ids": [ids["validator"]], "model": model},
            "rl": dict(DEMO_RL)}


def _publish(trainer_dir: Path, ids: dict[str, str], model: str) -> str:
    """The run as a signed manifest in the trainer's store (``run init`` without its calibration: the
    embedded model ships its thresholds); returns its CID."""
    from intellect_node.commands.run import model_files, seal_run
    from intellect_node.config.loader import build_config
    from intellect_node.config.run_manifest import run_sections
    from intellect_node.p2p.identity import load_key

    folder = Path(model)
    cfg = build_config(_run_config(ids, model))
    return seal_run(load_key(trainer_dir), trainer_dir, "bench-join", folder, model_files(folder),
                    run_sections(cfg), (folder / "proof_thresholds.json").read_text(), [], lambda _l: None)


def _config(data_dir: Path, ids: dict[str, str], model: str, bootstrap: list[str], by_cid: bool) -> None:
    """The node's ``config.toml``: the demo's network timings, and its run unless the run comes from a
    manifest (``--by-cid``)."""
    from intellect_node.node.processes import write_config

    network: dict[str, Any] = {"listen": ["/ip4/127.0.0.1/tcp/0"], "http_host": "127.0.0.1",
                               "heartbeat_interval": 1.0, "peer_timeout": 10.0}
    if bootstrap:
        network["bootstrap"] = bootstrap
    doc: dict[str, Any] = {"network": network, "metrics": {"enabled": False}}
    write_config(data_dir / "config.toml", doc if by_cid else {**doc, **_run_config(ids, model)})


def _start(data_dir: Path, role: str, procs: list[Any], ids: dict[str, str], model: str,
           bootstrap: list[str], cid: str = "") -> Any:
    from intellect_node.node.processes import NodeProcess

    data_dir.mkdir(parents=True, exist_ok=True)
    _config(data_dir, ids, model, bootstrap, bool(cid))
    run = ["--run", cid] if cid else []
    proc = NodeProcess.join(data_dir, "--role", role, *run, output=data_dir.parent / f"{data_dir.name}.log",
                            env=_env(), cwd=REPO)
    procs.append(proc)
    return proc


def _wait(what: str, timeout: float, predicate: Any) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def run_join(work: Path, workers: int, timeout: float, by_cid: bool = False) -> dict[str, Any]:
    from intellect_node.config.status import TIMELINE_STAGES
    from intellect_node.models.loader import embedded_model_dir
    from intellect_node.node.processes import stop_all
    from intellect_node.p2p.identity import init_key

    model = str(embedded_model_dir())
    names = ["trainer", "validator", *[f"w{i}" for i in range(workers)]]
    ids = {}
    for n in names:
        (work / n).mkdir(parents=True, exist_ok=True)
        ids[n] = init_key(work / n).peer_id
    cid = _publish(work / "trainer", ids, model) if by_cid else ""
    procs: list[Any] = []
    try:
        trainer = _start(work / "trainer", "trainer", procs, ids, model, [], cid)
        boot = [trainer.wait_ready(300)["listen_addrs"][0]]
        validator = _start(work / "validator", "validator", procs, ids, model, boot, cid)
        boot.append(validator.wait_ready(300)["listen_addrs"][0])
        for n in names[2:]:
            _start(work / n, "worker", procs, ids, model, boot, cid)
        # The swarm runs: the validator holds the trainer's policy (and, with workers, steps are taken).
        _wait("the validator to hold a policy", timeout,
              lambda: validator.status()["snapshot"]["policy"]["local"] >= 0)
        if workers:
            _wait("a first trainer step", timeout,
                  lambda: trainer.status()["snapshot"]["training"]["step"] >= 1)
        swarm_step = trainer.status()["snapshot"]["training"]["step"]

        spawned = time.time()
        fresh = _start(work / "fresh", "worker", procs, ids, model, boot, cid)

        def accepted() -> tuple[dict[str, Any], float] | None:
            if not fresh.alive():
                raise SystemExit(fresh.death_note())
            if not (fresh.data_dir / "control.json").exists():
                return None
            tl = fresh.status()["snapshot"]["timeline"]
            return (tl, time.time()) if tl["first_batch_accepted"] is not None else None
        tl, seen = _wait("the fresh worker's first accepted batch", timeout, accepted)
        verdicts = fresh.status()["snapshot"]["rollouts"]
    finally:
        stop_all(procs, 20.0)
    return {"workers_already": workers, "trainer_step_at_join": swarm_step, "by_cid": by_cid,
            "stages_s": {s: tl[s] for s in TIMELINE_STAGES},
            "exec_latency_s": round(tl["process_started_at"] - spawned, 3),
            "outside_view_s": round(seen - spawned, 3),
            "rollouts": {k: verdicts[k] for k in ("submitted", "accepted", "rejected")}}


def _timed(argv: list[str], **kw: Any) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    return time.monotonic() - t0


def _heaviest_imports(argv_tail: list[str], n: int = 5) -> list[tuple[str, float]]:
    """Top-level imports (cumulative ms) of ``python -X importtime <argv_tail>``."""
    out = subprocess.run([sys.executable, "-X", "importtime", *argv_tail], capture_output=True, text=True,
                         env=_env(), cwd=REPO)
    rows = []
    for line in out.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].startswith(" ") and not parts[2].startswith("  "):
            try:
                rows.append((parts[2].strip(), int(parts[1]) / 1000))
            except ValueError:
                continue  # the header line
    return sorted(rows, key=lambda r: -r[1])[:n]


def run_startup(work: Path, runs: int) -> dict[str, Any]:
    from intellect_node.node.processes import NodeProcess, cli_argv, stop_all

    helps = [_timed([*cli_argv(), "join", "--help"], env=_env()) for _ in range(runs)]
    ready, own = [], []
    for i in range(runs):
        d = work / f"bare{i}"
        t0 = time.monotonic()
        node = NodeProcess.join(d, "--metrics-port", "0", output=work / f"bare{i}.log", env=_env(), cwd=REPO)
        try:
            st = node.wait_ready(60)
            ready.append(time.monotonic() - t0)
            own.append(st["snapshot"]["timeline"]["ready"])
        finally:
            stop_all([node], 20.0)
    return {"join_help_s": round(statistics.median(helps), 3),
            "bare_node_status_s": round(statistics.median(ready), 3),
            "bare_node_ready_own_s": round(statistics.median(own), 3),
            "runs": runs,
            "heaviest_imports_ms": {
                "cli": _heaviest_imports(["-m", "intellect_node.cli", "join", "--help"]),
                "node": _heaviest_imports(["-c", "import intellect_node.cli, intellect_node.node.assembly, "
                                                 "intellect_node.p2p.nat.service, intellect_node.p2p.host"])}}


def report_join(r: dict[str, Any]) -> None:
    how = "by the run's CID (manifest and model fetched)" if r.get("by_cid") else "with the run's config"
    print(f"join of a fresh worker {how} ({r['workers_already']} workers already at work, trainer at step "
          f"{r['trainer_step_at_join']}); seconds from its process start:")
    prev = 0.0
    # in the order they happened: the roles start (and may fetch the policy) before the node reads ready
    for stage, t in sorted(r["stages_s"].items(), key=lambda kv: kv[1]):
        print(f"  {stage:24s} {t:7.2f} s  (+{t - prev:.2f})")
        prev = t
    total = r["stages_s"]["first_batch_accepted"]
    print(f"  total {total:.2f} s against the aim of {AIM_JOIN_S:.0f} s: ratio {total / AIM_JOIN_S:.2f} "
          f"({'met' if total <= AIM_JOIN_S else 'missed'}); outside view {r['outside_view_s']:.2f} s "
          f"(spawn to exec {max(0.0, r['exec_latency_s']):.2f} s, 10 ms ticks; {POLL_S} s polls)")


def report_startup(r: dict[str, Any]) -> None:
    print(f"start-up (median of {r['runs']}): `join --help` {r['join_help_s']:.2f} s; a node with no role "
          f"answers status {r['bare_node_status_s']:.2f} s after spawn (its own ready mark "
          f"{r['bare_node_ready_own_s']:.2f} s) against the aim of {AIM_START_S:.0f} s: ratio "
          f"{r['bare_node_status_s'] / AIM_START_S:.2f}")
    for what, rows in r["heaviest_imports_ms"].items():
        print(f"  heaviest imports ({what}): " + ", ".join(f"{m} {ms:.0f} ms" for m, ms in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["join", "startup"])
    ap.add_argument("--workers", type=int, default=0, help="workers at work before the fresh one joins")
    ap.add_argument("--runs", type=int, default=5, help="start-up measurements (the median is reported)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per wait before giving up")
    ap.add_argument("--by-cid", action="store_true", help="the run as a signed manifest, joined by its CID")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "join.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-join-"))
    try:
        if args.only in (None, "startup"):
            results["startup"] = run_startup(work / "startup", args.runs)
            report_startup(results["startup"])
        if args.only in (None, "join"):
            results["join"] = run_join(work / "join", args.workers, args.timeout, args.by_cid)
            report_join(results["join"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
