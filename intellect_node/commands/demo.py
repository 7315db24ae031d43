"""``intellect-node demo``: a complete swarm on this machine, one process per node, with the dashboard.

The demo is a thin orchestrator over the real CLI: it creates a key per node (so it knows the trainer's
peer ID before anything starts), writes one config file for the run, and starts every node at once, each
as its own process on 127.0.0.1: the trainer with ``intellect-node join --role trainer`` on a port picked
just before, the validators and workers bootstrapped to that address (:meth:`DemoSwarm.start`). It reads
every node's status snapshot through the node's control API (the same JSON ``intellect-node status``
shows) and renders them with the dashboard's swarm view.

``--headless --steps N --report FILE`` waits for N trainer steps and writes::

    {"steps": [{"step", "pass_rate", "reward_mean"}, ...], "rollouts": {"accepted", "rejected"}, ...}

Steps are read from the trainer's snapshot history (``StatusBoard.train_step``); rollouts from the
verdicts the validators issued (``StatusBoard.verdict``), or, without validators, the workers' counts.

Stopping (Ctrl-C, SIGTERM, or the steps reached): SIGTERM to each child by PID, a bounded wait, then
SIGKILL by PID for any that did not exit. Children run in their own session so a Ctrl-C reaches only the
demo, which stops them in order; on Linux they also get SIGTERM if the demo itself dies. Starting,
waiting for and stopping the children is ``node/processes.py``'s, shared with the sweep command and the
tests.

Logs outlive the demo: with the default temporary dir, a clean stop moves every node's log (and the
run's config) to ``<user log dir>/demo/<run-id>/`` (:func:`keep_logs`; ``~/.local/state/intellect-node/log``
on Linux) before removing the rest, and says where; a failed run keeps the whole dir and names it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from intellect_node.commands.common import parse_env_args
from intellect_node.errors import ConfigError, IntellectNodeError
from intellect_node.node.processes import (
    STOP_GRACE_S,
    NodeProcess,
    child_env,
    cli_argv,
    stop_all,
    write_config,
)
from intellect_node.p2p.ports import free_tcp_port

if TYPE_CHECKING:
    from intellect_node.config.status import StatusSnapshot
    from intellect_node.envs.tasks import Problem
    from intellect_node.inference.run_settings import Choice
    from intellect_node.inference.torch_engine import TorchEngine

Say = Callable[[str], object]
"""Where the demo reports a step (stderr, a progress line, a test's list)."""

START_ATTEMPTS = 3
"""Ports the demo tries for its trainer: another process can take the one picked before the trainer
binds it."""
READY_TIMEOUT_S = 120.0
"""Start-up bound per node: imports of torch and libp2p take seconds on a loaded 2-core machine."""
POLL_S = 0.5
DEMO_RL = dict(group_size=8, problems_per_batch=4, groups_per_step=8, max_new_tokens=5, lr=2e-4,
               batches_per_version=1, work_ahead=2)
"""Small, fast RL settings for a CPU demo: 8 samples per prompt, 64 per step, the 5 answer tokens, the
learning rate that lifted the embedded model fastest without collapsing it (as in bench/learning.py).
One batch per worker per version is what a step takes from two workers, and ``work_ahead`` 2 has each
worker make the batches of later steps while the trainer runs the current one (docs/training.md,
"Working ahead"): 150 steps took 40.5 s on 2 cores, against 76.3 s with two batches per version and no
work-ahead, which made twice the rollouts and trained on half of them."""


def demo_rl(workers: int) -> dict[str, Any]:
    """:data:`DEMO_RL` for ``workers`` workers: each makes ``groups_per_step / workers`` problems (rounded
    up) a batch, so one batch from each per version is at least a step. Fewer groups a version than a step
    would leave the trainer short until a worker's resubmission timer fired."""
    per = -(-int(DEMO_RL["groups_per_step"]) // workers)
    return {**DEMO_RL, "problems_per_batch": per}


@dataclass
class DemoNode:
    name: str
    role: str
    data_dir: Path
    peer_id: str = ""
    proc: Optional[NodeProcess] = None
    log_path: Path = field(default_factory=Path)

    @property
    def stderr_path(self) -> Path:
        return self.data_dir / "stderr.log"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()


DEMO_EVAL = {"eval_every": 5, "eval_problems": 128}
"""The demo's held-out evaluation: every 5th policy version, 128 problems of the embedded task held out of
training (about a second of the validator's time each; ``--config`` may set others, or 0 to turn it off)."""


class DemoSwarm:
    """The demo's child processes; :meth:`stop` kills only them, by PID."""

    def __init__(self, root: Path, *, workers: int, validators: int, run_id: str, model: str | None,
                 extra_config: dict[str, Any] | None = None) -> None:
        from intellect_node.p2p import identity

        if workers < 1 or validators < 1:
            raise ConfigError("--workers and --validators must be at least 1 (the trainer trains only on "
                              "work a validator accepted)", field="workers")
        self.root = root
        self.run_id = run_id
        self.nodes: list[DemoNode] = [DemoNode("trainer", "trainer", root / "trainer")]
        self.nodes += [DemoNode(f"validator{i}", "validator", root / f"validator{i}")
                       for i in range(validators)]
        self.nodes += [DemoNode(f"worker{i}", "worker", root / f"worker{i}") for i in range(workers)]
        for node in self.nodes:
            identity.ensure_data_dir(node.data_dir)
            node.peer_id = identity.load_or_init_key(node.data_dir).peer_id
            node.log_path = node.data_dir / "node.log"
        self.trainer = self.nodes[0]
        self.config_path = root / "demo.toml"
        """The run's whole configuration (what its manifest carries, with this machine's paths)."""
        self.node_config_path = root / "node.toml"
        """What each node adds of its own to the manifest's settings (network, metrics, inference...)."""
        self.cid = ""
        self._write_config(model, extra_config or {})
        from intellect_node.node.warmstart import WarmStarter

        self._starter = WarmStarter()
        """Every node forked from one server that imported torch and the node once (``node/warmstart``)."""

    def _write_config(self, model: str | None, extra: dict[str, Any]) -> None:
        from intellect_node.config import load_config

        # Keys exist before any process starts, so the run's trust roots are known up front: the trainer
        # announces policies, the validators' verdicts are the only ones the trainer trains on.
        run: dict[str, Any] = {"run_id": self.run_id, "trainer_peer_id": self.trainer.peer_id,
                               "validator_peer_ids": [n.peer_id for n in self.nodes if n.role == "validator"]}
        if model:
            run["model"] = model
        doc: dict[str, Any] = {"network": {"listen": ["/ip4/127.0.0.1/tcp/0"], "http_host": "127.0.0.1",
                                           "heartbeat_interval": 1.0, "peer_timeout": 10.0}, "run": run}
        # Held-out evaluation on (DEMO_EVAL): the validators evaluate every few versions on problems held
        # out of training and sign the figures, which the dashboard, `status` and `runs` show.
        run.update(DEMO_EVAL)
        for section, values in extra.items():
            doc.setdefault(section, {}).update(values)
        self.evaluates = bool(doc["run"].get("eval_every"))
        if self.evaluates:
            doc.setdefault("validator", {}).setdefault("evaluate", True)
        write_config(self.config_path, doc)
        cfg = load_config(self.config_path, environ={})  # fail here, naming the field, not in four children
        self.cid = self._publish(cfg)
        # Each node's own config: every section but the run-wide ones, which come from the manifest.
        from intellect_node.config.run_manifest import LOCAL_FIELDS, RUN_SECTIONS

        local = {k: v for k, v in doc.items() if k not in RUN_SECTIONS}
        for section in RUN_SECTIONS:
            kept = {k: v for k, v in doc.get(section, {}).items()
                    if f"{section}.{k}" in LOCAL_FIELDS and k not in ("model", "proof_thresholds")}
            if kept:
                local[section] = kept
        write_config(self.node_config_path, local)

    def _publish(self, cfg: Any) -> str:
        """The demo's run as a signed manifest in the trainer's store (the trainer organises it): the
        trainer serves it and every other node joins by its CID, as participants of a real run do."""
        from intellect_node.commands.run import model_files, seal_run
        from intellect_node.config.run_manifest import run_sections
        from intellect_node.models.loader import resolve_model_dir
        from intellect_node.p2p import identity
        from intellect_node.proofs.thresholds import THRESHOLDS_FILE

        folder = resolve_model_dir(cfg.run.model or None)
        thresholds = Path(cfg.run.proof_thresholds) if cfg.run.proof_thresholds else folder / THRESHOLDS_FILE
        key = identity.load_key(self.trainer.data_dir)
        return seal_run(key, self.trainer.data_dir, self.run_id, folder, model_files(folder),
                        run_sections(cfg), thresholds.read_text(), [], lambda _line: None)

    def _spawn(self, node: DemoNode, bootstrap: list[str], listen: str | None = None) -> None:
        args = [*cli_argv(), "join", "--headless", "--role", node.role, "--data-dir", str(node.data_dir),
                "--run", self.cid, "--config", str(self.node_config_path), "--log-file", str(node.log_path)]
        if listen is not None:
            args += ["--listen", listen]
        for addr in bootstrap:
            args += ["--bootstrap", addr]
        # The demo is self-contained: the operator's INTELLECT_NODE_* settings are not applied to it.
        env = child_env({"MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, drop_prefix="INTELLECT_NODE_")
        node.proc = NodeProcess(args, node.data_dir, name=node.name, output=node.stderr_path, env=env,
                                log_file=node.log_path, new_session=True, starter=self._starter)

    def _wait_ready(self, node: DemoNode, deadline: float) -> dict[str, Any]:
        assert node.proc is not None
        return node.proc.wait_ready(max(0.0, deadline - time.monotonic()))

    def _death_note(self, node: DemoNode) -> str:
        if node.proc is None:
            return f"{node.name} was not started (logs in {node.data_dir})"
        return node.proc.death_note()

    def start(self, progress: Say | None = None) -> None:
        """Every node at once: the trainer on a port picked just before, the others bootstrapped to it.

        They import torch and libp2p side by side instead of waiting for the trainer's start-up, and dial
        the trainer again until it answers. If another process takes the port before the trainer binds
        it (the trainer then exits 2, naming the port), everything stops and starts again on another
        port, up to START_ATTEMPTS times."""
        say = progress or (lambda _m: None)
        for attempt in range(1, START_ATTEMPTS + 1):
            port = free_tcp_port()
            say(f"starting the trainer ({self.trainer.peer_id[-8:]}) on 127.0.0.1:{port} and "
                f"{len(self.nodes) - 1} more nodes")
            self._spawn(self.trainer, [], listen=f"/ip4/127.0.0.1/tcp/{port}")
            boot = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{self.trainer.peer_id}"]
            for node in self.nodes[1:]:
                self._spawn(node, boot)
            deadline = time.monotonic() + READY_TIMEOUT_S
            try:
                self._wait_ready(self.trainer, deadline)
            except IntellectNodeError:
                if attempt == START_ATTEMPTS or not self._trainer_lost_its_port():
                    raise
                say(f"port {port} was taken before the trainer could listen on it; starting again")
                self.stop()
                continue
            for node in self.nodes[1:]:
                self._wait_ready(node, deadline)
            return

    def _trainer_lost_its_port(self) -> bool:
        """The trainer exited because its listen port is in use (``ports.check_listen_ports``)."""
        proc = self.trainer.proc
        return proc is not None and proc.proc.poll() == 2 and "already in use" in proc.output_text()

    def dead(self) -> list[DemoNode]:
        return [n for n in self.nodes if n.proc is not None and not n.proc.alive()]

    def snapshots(self, placeholders: bool = False) -> list[StatusSnapshot]:
        """Status snapshot of every node that answers (a starting or stopping node is skipped, or shown
        as ``unreachable`` with ``placeholders``: the dashboard must not drop a node that stopped
        answering)."""
        from intellect_node.config.status import StatusSnapshot

        out: list[StatusSnapshot] = []
        for node in self.nodes:
            if node.proc is None or not node.proc.alive():
                continue
            try:
                doc = node.proc.status(timeout=3.0)
                out.append(StatusSnapshot.from_json(json.dumps(doc["snapshot"])))
            except (IntellectNodeError, KeyError, TypeError) as exc:
                if placeholders:
                    out.append(StatusSnapshot.unreachable(role=node.role, peer_id=node.peer_id,
                                                          detail=str(exc)[:120]))
                continue
        return out

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every child (workers first, trainer last), wait, SIGKILL the rest; exit codes by name."""
        started = [n for n in reversed(self.nodes) if n.proc is not None]
        codes = stop_all([n.proc for n in started if n.proc is not None], STOP_GRACE_S)
        return {n.name: code for n, code in zip(started, codes)}


class StepLog:
    """Trainer steps gathered across polls (a snapshot keeps only the most recent few hundred), and the
    trainer's learning diagnosis: step attempts with no learnable group, by cause, and its warning."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.learning: dict[str, Any] = {"attempts": 0, "no_signal_attempts": 0, "no_signal_causes": {},
                                         "warning": "", "last_warning": ""}

    def update(self, snaps: Sequence[StatusSnapshot]) -> None:
        for s in snaps:
            if s.role == "trainer" or s.training.history:
                for p in s.training.history:
                    self.steps[p.step] = {"step": p.step, "pass_rate": p.pass_rate,
                                          "reward_mean": p.reward_mean}
            if "trainer" in s.role.split(","):
                t = s.training
                self.learning.update(attempts=t.attempts, no_signal_attempts=t.no_signal_attempts,
                                     no_signal_causes=dict(t.no_signal_causes), warning=t.no_signal_warning)
                if t.no_signal_warning:
                    self.learning["last_warning"] = t.no_signal_warning

    def ordered(self) -> list[dict[str, float]]:
        return [self.steps[k] for k in sorted(self.steps)]


def rollout_counts(snaps: Sequence[StatusSnapshot]) -> dict[str, int]:
    """Verdicts issued by validators when there are any, else what workers were told."""
    validators = [s for s in snaps if "validator" in s.role.split(",")]
    source = validators or [s for s in snaps if "worker" in s.role.split(",")]
    return {"accepted": sum(s.rollouts.accepted for s in source),
            "rejected": sum(s.rollouts.rejected for s in source),
            "generated": sum(s.rollouts.generated for s in snaps if "worker" in s.role.split(","))}


def demo_log_root() -> Path:
    """Where a stopped demo's logs go: the platform's user log dir (``$XDG_STATE_HOME`` on Linux)."""
    import platformdirs

    return Path(platformdirs.user_log_dir("intellect-node", appauthor=False)) / "demo"


def keep_logs(swarm: DemoSwarm, dest: Path) -> Path:
    """Move every node's logs and the run's config from the demo's dir to ``dest`` (0700, one file per
    node and stream: ``trainer.log``, ``trainer.stderr.log``, ...); returns ``dest``.

    Why move rather than leave them: the default dir is a temporary one that is removed after a clean
    stop (it holds blobs and checkpoints); the logs are what an operator looks at afterwards."""
    from intellect_node.p2p.identity import ensure_data_dir

    ensure_data_dir(dest)
    for node in swarm.nodes:
        for src, name in ((node.log_path, f"{node.name}.log"), (node.stderr_path, f"{node.name}.stderr.log")):
            if src.exists():
                shutil.move(str(src), str(dest / name))
    if swarm.config_path.exists():
        shutil.copy2(swarm.config_path, dest / swarm.config_path.name)
    return dest


def run_headless(swarm: DemoSwarm, steps: int, timeout: float, report: Optional[Path]) -> int:
    from intellect_node import dashboard

    log = StepLog()
    snaps: list[StatusSnapshot] = []
    counts = {"accepted": 0, "rejected": 0, "generated": 0}
    t0 = time.monotonic()
    next_line = 0.0
    warned = ""
    reason = "timeout"
    held_out: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        dead = swarm.dead()
        if dead:
            reason = "node died"
            typer.echo(swarm._death_note(dead[0]), err=True)
            break
        snaps = swarm.snapshots()
        log.update(snaps)
        for s in snaps:  # the newest held-out result any validator took (DEMO_EVAL)
            if s.held_out.version >= 0 and s.held_out.version >= held_out.get("version", -1):
                held_out = {k: getattr(s.held_out, k) for k in ("version", "n", "pass_rate", "mean_reward",
                                                                "evaluator", "confirmed", "refused")}
        if snaps:
            counts = rollout_counts(snaps) if len(snaps) == len(swarm.nodes) else counts
        if time.monotonic() >= next_line:
            for s in snaps:
                typer.echo(f"{dashboard.clock(s.ts)} {dashboard.status_line(s)}", err=True)
            next_line = time.monotonic() + 10.0
        if log.learning["warning"] and log.learning["warning"] != warned:
            warned = log.learning["warning"]
            typer.echo(f"NOT LEARNING: {warned}", err=True)
        # With evaluation on, the report also waits for the first held-out result (policy v0's).
        if len(log.steps) >= steps and (held_out or not swarm.evaluates):
            reason = "steps reached"
            break
        time.sleep(POLL_S)
    elapsed = time.monotonic() - t0
    codes = swarm.stop()
    doc = {"steps": log.ordered()[:steps], "rollouts": {"accepted": counts["accepted"],
                                                      "rejected": counts["rejected"]},
           "rollouts_generated": counts["generated"], "learning": log.learning,
           "held_out": held_out or None,
           "requested_steps": steps, "stopped_because": reason,
           "seconds": round(elapsed, 1), "run_id": swarm.run_id, "exit_codes": codes,
           "nodes": [{"name": n.name, "role": n.role, "peer_id": n.peer_id} for n in swarm.nodes]}
    text = json.dumps(doc, indent=2)
    if report:
        from intellect_node.fsutil import atomic_write_text

        atomic_write_text(report, text + "\n")
        typer.echo(f"report written to {report}", err=True)
    else:
        typer.echo(text)
    ok = reason == "steps reached" and all(c == 0 for c in codes.values())
    if not ok:
        typer.echo(f"demo ended early: {reason}; exit codes {codes}", err=True)
        if log.learning["last_warning"]:
            typer.echo(f"the run was not learning: {log.learning['last_warning']}", err=True)
    return 0 if ok else 1


def run_dashboard(swarm: DemoSwarm) -> int:
    from rich.console import Console

    from intellect_node import dashboard

    stop = threading.Event()

    def source() -> list[StatusSnapshot]:
        dead = swarm.dead()
        if dead:
            stop.set()
        return swarm.snapshots(placeholders=True)

    console = Console()
    try:
        dashboard.run(source, stop, console=console, swarm_view=True, refresh_s=1.0,
                      title="intellect-node demo", footer="Ctrl-C stops every node")
    except KeyboardInterrupt:
        pass
    dead = swarm.dead()
    console.print("stopping the nodes…")
    codes = swarm.stop()
    if dead:
        console.print(swarm._death_note(dead[0]))
        return 1
    console.print(f"stopped: {', '.join(f'{k} {v}' for k, v in codes.items())}")
    return 0


def demo_thresholds(model: str, base: Path, progress: Say | None = None, *, engine: TorchEngine | None = None,
                    problems: Sequence[Problem] | None = None, max_new_tokens: int | None = None,
                    temperature: float = 1.0) -> Path:
    """The model folder's thresholds when they cover the demo's pair (torch@cpu), else a quick
    calibration of that pair written into the demo's own directory: a model brought with --model rarely
    ships thresholds, and the validators refuse to start without them.

    The calibration samples the run's own ``problems`` (its prompts) with the run's ``max_new_tokens`` and
    ``temperature``: the figures depend on the prompts' lengths and the completions' shapes, so thresholds
    calibrated on the embedded task's 5-token sums do not hold a real model's 16-token answers."""
    from intellect_node.models.loader import resolve_model_dir
    from intellect_node.proofs.thresholds import THRESHOLDS_FILE, load_thresholds

    folder = resolve_model_dir(model)
    try:
        load_thresholds(folder, "float32")
        return folder / THRESHOLDS_FILE
    except IntellectNodeError:
        pass
    import json

    import torch

    from intellect_node.fsutil import atomic_write_text
    from intellect_node.inference import SamplingConfig, make_engine
    from intellect_node.inference.calibrate import calibrate
    from intellect_node.proofs.thresholds import merge_into

    new_tokens = int(DEMO_RL["max_new_tokens"]) if max_new_tokens is None else max_new_tokens
    if progress:
        progress(f"calibrating proof thresholds for {folder.name} (torch@cpu, 32 honest rollouts of the "
                 f"run's prompts, {new_tokens} new tokens)")
    torch.set_num_threads(1)
    path = base / THRESHOLDS_FILE
    engine = engine if engine is not None else make_engine(folder, "torch")
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature)
    for cal in calibrate(engine, n=32, batch_sizes=(1, 8), sampling=sampling,
                         problems=list(problems) if problems is not None else None):
        atomic_write_text(path, json.dumps(merge_into(path, cal), indent=2) + "\n")
    return path


@dataclass
class DemoPlan:
    """What the demo runs: the model folder, the config sections beyond the demo's own, the settings
    chosen for the model (with why), and the worker count."""

    folder: Path | None
    extra: dict[str, dict[str, Any]]
    choices: list[Choice]
    workers: int
    notes: list[str] = field(default_factory=list)


def plan_demo(*, model: str | None, env: str | None, env_args: dict[str, Any], config_file: Path | None,
              workers: int | None) -> DemoPlan:
    """The demo's run: ``--config``'s sections, then the settings that fit the model
    (:func:`inference.run_settings.fit_settings`: a model other than the embedded one), then the flags.
    The demo's own pipeline settings (:data:`DEMO_RL`) fill what is left."""
    from intellect_node.inference.run_settings import apply, fit_settings, model_facts
    from intellect_node.models.loader import resolve_model_dir

    doc: dict[str, Any] = {}
    if config_file is not None:
        from intellect_node.config.loader import read_toml

        doc = read_toml(config_file)
    extra: dict[str, dict[str, Any]] = {k: dict(v) for k, v in doc.items() if isinstance(v, dict)}
    for section in ("network", "metrics"):
        extra.pop(section, None)  # the demo's nodes listen on loopback with their own ports
    run = extra.setdefault("run", {})
    for key in ("run_id", "trainer_peer_id", "validator_peer_ids"):
        run.pop(key, None)  # the demo makes its own keys
    from_file = run.pop("model", None)
    model = model or from_file or None
    folder = resolve_model_dir(model) if model else None
    given = dict(extra.get("rl", {}))
    if env:
        given["env"] = env
    if env_args:
        given["env_args"] = env_args
    facts = model_facts(folder) if folder is not None else None
    choices = fit_settings(facts, given) if facts is not None else []
    chosen = apply(choices) if choices else given
    notes: list[str] = []
    if workers is None:
        workers = 1 if facts is not None and facts.n_params > 50e6 and (os.cpu_count() or 1) <= 4 else 2
        if workers == 1 and facts is not None:
            notes.append(f"1 worker: a {facts.n_params / 1e6:.0f}M model on {os.cpu_count()} cores "
                         "(--workers sets more)")
    rl = {**demo_rl(workers), **chosen}
    if "problems_per_batch" not in given:
        rl["problems_per_batch"] = -(-int(rl["groups_per_step"]) // workers)
    extra["rl"] = rl
    return DemoPlan(folder=folder, extra=extra, choices=choices, workers=workers, notes=notes)


def preflight_and_thresholds(plan: DemoPlan, base: Path, say: Say) -> None:
    """For a model brought with --model: the starting policy's solve rate on a sample of the run's
    problems (a warning when no group can be learned from), and the proof thresholds calibrated on the
    run's own prompts (``run.proof_thresholds``) unless the folder or ``--config`` has them."""
    assert plan.folder is not None
    import torch

    from intellect_node.config import load_config
    from intellect_node.inference import make_engine
    from intellect_node.inference.run_settings import preflight
    from intellect_node.node.processes import write_config
    from intellect_node.roles.common.tasks import run_task

    torch.set_num_threads(1)
    probe = base / "plan.toml"
    write_config(probe, {**plan.extra, "run": {**plan.extra.get("run", {}), "model": str(plan.folder)}})
    cfg = load_config(probe, environ={})  # a bad setting fails here, naming the field
    probe.unlink()
    task = run_task(cfg)
    problems = task.sample(random.Random(7), 32)
    engine = make_engine(plan.folder, "torch", dtype=cfg.run.dtype)
    say(f"preflight: sampling {cfg.rl.group_size} completions of 8 problems with the run's settings")
    pre = preflight(engine, problems[:8], group_size=cfg.rl.group_size, max_new_tokens=cfg.rl.max_new_tokens,
                    temperature=cfg.rl.temperature)
    say(pre.summary())
    for answer, text, reward in pre.examples[:2]:
        say(f"  e.g. expected {answer!r}, wrote {text[:80]!r}: reward {reward:.2f}")
    if not cfg.run.proof_thresholds:
        path = demo_thresholds(str(plan.folder), base, progress=say, engine=engine, problems=problems,
                               max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature)
        plan.extra.setdefault("run", {})["proof_thresholds"] = str(path)


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        workers: Optional[int] = typer.Option(None, "--workers", min=1, max=8,
                                              help="Worker nodes (generate rollouts; default 2, or 1 for a "
                                                   "model over 50M parameters on a machine of 4 cores or "
                                                   "fewer)."),
        validators: int = typer.Option(1, "--validators", min=1, max=4,
                                       help="Validator nodes (check proofs; the trainer trains only on "
                                            "work they accepted)."),
        headless: bool = typer.Option(False, "--headless", help="No dashboard: run --steps trainer steps, "
                                                                "then write the report."),
        steps: int = typer.Option(20, "--steps", min=1, max=100_000,
                                  help="Trainer steps to run (--headless)."),
        report: Optional[Path] = typer.Option(None, "--report",
                                              help="Write the JSON report here (--headless; "
                                                   "default: stdout)."),
        timeout: float = typer.Option(1800.0, "--timeout", min=10, help="Give up after this many seconds "
                                                                        "(--headless); exit code 1."),
        model: Optional[str] = typer.Option(None, "--model",
                                            help="Model folder or .gguf file (default: the embedded "
                                                 "model). Settings that fit it are chosen and printed."),
        root: Optional[Path] = typer.Option(None, "--dir", help="Keep the nodes' data dirs here (default: a "
                                                                 "temporary dir, removed after a clean stop; "
                                                                 "the logs move to the user log dir)."),
        run_id: str = typer.Option("", "--run-id", help="Run ID (default: demo-<random>)."),
        env: Optional[str] = typer.Option(None, "--env", help="Reward environment (rl.env), e.g. "
                                          "reasoning_gym:basic_arithmetic (default: the embedded task, or "
                                          "basic_arithmetic for another model)."),
        env_args: Optional[str] = typer.Option(None, "--env-args",
                                               help="The environment's settings (rl.env_args): JSON, or "
                                                    "key=value pairs, e.g. max_digits=1,max_terms=2."),
        config_file: Optional[Path] = typer.Option(None, "--config",
                                                   help="A node config file whose [rl], [run] (model, "
                                                        "dtype, thresholds), [validator] and [inference] "
                                                        "settings the demo's run takes; flags win."),
    ) -> None:
        """Run a whole swarm locally (trainer, validator, two workers) on the embedded model and task.

        With a terminal it shows the dashboard until Ctrl-C; `--headless --steps N --report FILE` runs N
        trainer steps and writes {"steps": [{step, pass_rate, reward_mean}], "rollouts": {accepted,
        rejected}}. Every node is a real `intellect-node join` process on 127.0.0.1. With --model, the
        settings that fit the model and task are chosen and printed, a preflight samples the starting
        policy on the run's problems, and proof thresholds are calibrated on the run's own prompts.
        """
        def say(m: str) -> None:
            typer.echo(m, err=True)

        plan = plan_demo(model=model, env=env, env_args=parse_env_args(env_args), config_file=config_file,
                         workers=workers)
        temp = root is None
        base = Path(tempfile.mkdtemp(prefix="intellect-demo-")) if root is None else root.expanduser()
        base.mkdir(parents=True, exist_ok=True)
        rid = run_id or f"demo-{os.urandom(3).hex()}"
        if plan.folder is not None:
            say(f"model {plan.folder}; settings for it ([rl]):")
            for c in plan.choices:
                say(c.line())
            for note in plan.notes:
                say(note)
            preflight_and_thresholds(plan, base, say)
        swarm = DemoSwarm(base, workers=plan.workers, validators=validators, run_id=rid,
                          model=str(plan.folder) if plan.folder is not None else None,
                          extra_config=plan.extra)
        typer.echo(f"run {rid}: node data and logs in {base}" + (" (logs kept after a stop)" if temp else ""),
                   err=True)
        use_dashboard = not headless and sys.stdout.isatty()
        stopping = {"sig": False}

        def on_term(_signum: int, _frame: Any) -> None:
            stopping["sig"] = True
            raise KeyboardInterrupt  # unwinds into the same clean stop as Ctrl-C

        old = signal.signal(signal.SIGTERM, on_term)
        # Ctrl-C and `kill -INT` stop the demo even when it was started with SIGINT ignored (a
        # non-interactive shell's `&` does that to its background jobs, and Python keeps it ignored).
        old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        code = 1
        try:
            try:
                swarm.start(progress=lambda m: typer.echo(m, err=True))
            except IntellectNodeError as exc:
                typer.echo(f"demo could not start: {exc}", err=True)
                swarm.stop()
                raise typer.Exit(1) from exc
            if use_dashboard:
                code = run_dashboard(swarm)
            elif headless or report:
                code = run_headless(swarm, steps, timeout, report)
            else:  # no terminal and not headless: plain log lines until Ctrl-C / SIGTERM
                code = run_dashboard(swarm)
        except KeyboardInterrupt:
            swarm.stop()
            code = 0 if stopping["sig"] or not headless else 130
        finally:
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGINT, old_int)
            if temp and code == 0:
                try:
                    kept = keep_logs(swarm, demo_log_root() / rid)
                except OSError as exc:  # no writable log dir: keep the demo's own dir instead
                    typer.echo(f"could not move the logs ({exc}); node data and logs kept in {base}",
                               err=True)
                else:
                    shutil.rmtree(base, ignore_errors=True)
                    typer.echo(f"logs kept in {kept}", err=True)
            else:
                typer.echo(f"node data and logs kept in {base}", err=True)
        raise typer.Exit(code)
