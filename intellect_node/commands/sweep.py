"""``intellect-node sweep``: research sweeps farmed out to the swarm, spot-checked by re-execution.

``sweep polysemanticity --grid smoke --workers K --out DIR`` starts a coordinator node in this process and
K worker nodes as child processes on 127.0.0.1, runs the grid, and writes ``DIR/results.jsonl``,
``DIR/summary.json`` and ``DIR/plot.png``. ``--join MULTIADDR`` starts no workers: the coordinator joins a
running swarm and waits for its sweep workers (``intellect-node sweep worker --bootstrap ...``).
``--resume`` continues from ``DIR/journal.jsonl`` after an interruption.

Local workers are child processes of the coordinator (``node/processes.py``): each in
``DIR/workers/w<i>``, stopped by PID when the sweep ends, and sent SIGTERM by the kernel if the
coordinator dies. Both nodes are put together by ``node/assembly.py``.

A sweep runs for minutes to hours, so it reports progress while it runs (``commands/progress.py``): the
coordinator starting, the local workers arriving, then jobs done of all, with checks and bans.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.commands.progress import Progress
    from intellect_node.node.processes import NodeProcess
    from intellect_node.node.runtime import NodeRuntime
    from intellect_node.research.sweep import Coordinator, Journal
    from intellect_node.roles.sweep import SweepCoordinatorService

log = logging.getLogger(__name__)

LOCAL_HEARTBEAT_S = 1.0
LOCAL_PEER_TIMEOUT_S = 15.0
"""Generous for loopback: on a loaded 2-core machine heartbeats can stall for several seconds."""
LOCAL_CHECK_GRACE_S = 10.0
"""Local workers claim every few seconds, so ten quiet seconds mean no other peer can take a check."""
JOIN_CHECK_GRACE_S = 120.0
WORKER_STOP_S = 15.0
MAX_LOCAL_WORKERS = 64


SWEEP_RUN_ID = "sweep"
"""The run both ``sweep polysemanticity`` and ``sweep worker`` use unless told: a worker started with no
``--run-id`` must hear the coordinator's offers (it listened on "default" before)."""

def local_worker_argv(index: int, flags: list[str]) -> list[str]:
    """The command line of local worker ``index``: ``intellect-node sweep worker FLAGS``. Looked up at
    each start, so a test's launcher can start some workers its own way (tests/support/sweep.py starts
    dishonest ones: the product ships no switch that makes a worker cheat)."""
    from intellect_node.node.processes import cli_argv

    return [*cli_argv(), "sweep", "worker", *flags]


def _spawn_worker(i: int, root: Path, *, bootstrap: str, run_id: str, coordinator: str) -> "NodeProcess":
    from intellect_node.node.processes import NodeProcess, child_env

    wdir = root / "workers" / f"w{i}"
    flags = ["--data-dir", str(wdir), "--bootstrap", bootstrap, "--run-id", run_id,
             "--coordinator", coordinator, "--heartbeat-interval", str(LOCAL_HEARTBEAT_S),
             "--peer-timeout", str(LOCAL_PEER_TIMEOUT_S),
             "--log-file", str(wdir / "worker.log")]
    return NodeProcess(local_worker_argv(i, flags), wdir, name=f"w{i}", output=wdir / "stderr.log",
                       env=child_env(), log_file=wdir / "worker.log")


def _open_sweep(out: Path, *, grid_name: str, resume: bool, check_fraction: float, check_grace: float,
                max_votes: int) -> tuple[Coordinator, Journal, str, str]:
    """The coordinator state and journal: new (``--grid``) or replayed from ``out/journal.jsonl``."""
    from intellect_node.research import sweep as research

    journal = research.Journal(out / "journal.jsonl")
    if resume:
        header, events = journal.load()
        coord = research.Coordinator.restore(header, events)
        # The previous coordinator is gone, and with it its local workers: put their grants back now
        # (a late result from a still-running remote worker is accepted all the same).
        now = time.time()
        for peer in {p for j in coord.jobs.values() for p in j.inflight}:
            coord.peer_gone(peer, now)
        journal.append(coord.drain())
        return coord, journal, header["sweep_id"], header["grid"]
    jobs = research.grid(grid_name)
    coord = research.Coordinator(jobs, salt=secrets.token_bytes(16), check_fraction=check_fraction,
                                 max_votes=max_votes, check_grace_s=check_grace, started=time.time())
    sweep_id = f"{grid_name}-{secrets.token_hex(4)}"
    journal.create({**coord.header(), "sweep_id": sweep_id, "grid": grid_name, "created": time.time()})
    return coord, journal, sweep_id, grid_name


async def _run_sweep(out: Path, coord: Coordinator, journal: Journal, *, sweep_id: str, grid_name: str,
                     workers: int, join: list[str], listen: list[str], run_id: str,
                     progress: Progress) -> tuple[dict[str, object] | None, str]:
    from intellect_node.commands.join import build_node_config
    from intellect_node.node.assembly import sweep_coordinator_node
    from intellect_node.node.processes import stop_all
    from intellect_node.roles.sweep import SweepCoordinatorService

    local = not join
    cfg = build_node_config(listen=listen, bootstrap=join, run_id=run_id, trainer_peer_id=None,
                            http_host=None, http_port=0, http_public_url=None, control_port=0,
                            heartbeat_interval=LOCAL_HEARTBEAT_S if local else None,
                            peer_timeout=LOCAL_PEER_TIMEOUT_S if local else None)
    services: list[SweepCoordinatorService] = []

    def factory(rt: NodeRuntime) -> SweepCoordinatorService:
        svc = SweepCoordinatorService(rt.swarm, coord, journal, sweep_id=sweep_id, out=out,
                                      meta={"grid": grid_name, "workers": workers if local else None},
                                      min_workers=workers if local else 0)
        services.append(svc)
        return svc

    runtime = sweep_coordinator_node(cfg, out / "coordinator", factory)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, runtime.request_stop)
    procs: list[NodeProcess] = []
    outcome = "interrupted"
    try:
        progress.phase("starting the coordinator")
        await runtime.start()
        svc = services[0]
        if local:
            swarm = runtime.swarm
            assert swarm is not None  # start() returned: the swarm runs
            addr = swarm.listen_addrs()[0]
            # From this (the main) thread: the kernel's SIGTERM-on-parent-death follows the starting thread.
            procs = [_spawn_worker(i, out, bootstrap=addr, run_id=run_id, coordinator=swarm.peer_id)
                     for i in range(workers)]
            log.info("started %d local workers (pids %s)", workers, ", ".join(str(p.pid) for p in procs))
            progress.phase("waiting for workers", total=workers, unit="workers")
        stop = asyncio.ensure_future(runtime.wait_stopped())
        while not svc.done.is_set() and not stop.done():
            _report(progress, svc, workers if local else 0)
            if procs and not any(p.alive() for p in procs):
                outcome = "workers exited"
                break
            await asyncio.wait([stop, asyncio.ensure_future(svc.done.wait())], timeout=0.5,
                               return_when=asyncio.FIRST_COMPLETED)
        if svc.done.is_set():
            outcome = "finished"
        stop.cancel()
        return svc.summary, outcome
    finally:
        progress.phase("stopping")
        # The coordinator first: workers then lose one peer, instead of it re-dialling each dead worker.
        await runtime.stop()
        await asyncio.to_thread(stop_all, procs, WORKER_STOP_S)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _report(progress: Progress, svc: SweepCoordinatorService, local_workers: int) -> None:
    """One progress step from the coordinator's state (read on its own loop: no locking needed)."""
    if local_workers and not svc.started_at:  # claims are held until every local worker has asked
        progress.update(len(svc.workers_seen))
        return
    c = svc.coord.counts()
    if c["open"] == 0:  # every job settled: the coordinator writes results.jsonl, summary and plot
        if progress.phase_name != "writing results":
            progress.phase("writing results", jobs=c["jobs"])
        return
    if progress.phase_name != "running jobs":
        progress.phase("running jobs", total=c["jobs"], unit="jobs")
    progress.update(c["done"] + c["unresolved"], workers=len(svc.workers_seen), inflight=c["inflight"],
                    checks=c["checks"], banned=c["banned"])


def register(app: typer.Typer) -> None:
    sweep = typer.Typer(help="Research sweeps: many small training runs farmed out to peers, spot-checked "
                             "by re-execution, aggregated into a result.", no_args_is_help=True)

    @sweep.command("polysemanticity")
    def polysemanticity(
        grid: str = typer.Option("smoke", "--grid",
                                 help="smoke (n=64, 40 runs, minutes), paper (n=256, 256 runs, hours), noise "
                                      "(noise variant, 35 runs), tiny (a few seconds; tests)."),
        workers: int = typer.Option(2, "--workers", "-k",
                                    help="Local worker processes to start (1 or more)."),
        out: Path = typer.Option(..., "--out", "-o", help="Output directory: results.jsonl, summary.json, "
                                                          "plot.png, journal.jsonl, node data."),
        join: list[str] = typer.Option([], "--join",
                                       help="Submit to a running swarm through this peer (multiaddr ending "
                                            "/p2p/<id>, repeatable) instead of starting local workers."),
        resume: bool = typer.Option(False, "--resume", help="Continue the sweep journalled in --out."),
        check_fraction: float = typer.Option(0.05, "--check-fraction", min=0.0, max=1.0,
                                             help="Share of jobs re-executed by a second peer."),
        check_grace: Optional[float] = typer.Option(None, "--check-grace", min=0.0,
                                                    help="Seconds a check may wait for an eligible peer "
                                                         "before it is waived (default 10 local, 120 with "
                                                         "--join)."),
        run_id: str = typer.Option(SWEEP_RUN_ID, "--run-id",
                                   help="Run (gossip topic namespace) of the sweep."),
        listen: list[str] = typer.Option([], "--listen", help="Coordinator's libp2p listen multiaddr."),
        max_votes: int = typer.Option(4, "--max-votes", hidden=True),
        log_level: str = typer.Option("WARNING", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
    ) -> None:
        """Reproduce "incidental polysemanticity" (arXiv 2312.03096) on a swarm of workers."""
        from intellect_node.commands.progress import Progress
        from intellect_node.logsetup import setup_logging

        if not join and not 1 <= workers <= MAX_LOCAL_WORKERS:
            raise ConfigError(f"--workers {workers}: use 1 to {MAX_LOCAL_WORKERS} local workers",
                              field="workers")
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is a file; give a directory", field="out")
        out.mkdir(parents=True, exist_ok=True)
        setup_logging(level=log_level, json_lines=False, file=None)
        grace = (check_grace if check_grace is not None
                 else JOIN_CHECK_GRACE_S if join else LOCAL_CHECK_GRACE_S)
        coord, journal, sweep_id, grid_name = _open_sweep(out, grid_name=grid, resume=resume,
                                                          check_fraction=check_fraction, check_grace=grace,
                                                          max_votes=max_votes)
        if resume:
            coord.check_grace_s = grace
        t0 = time.monotonic()
        from intellect_node.research import sweep as research

        summary: dict[str, object] | None
        if coord.finished():
            summary = research.write_outputs(out, coord, meta={"grid": grid_name, "sweep_id": sweep_id})
            outcome = "finished"
        else:
            with Progress(f"sweep {sweep_id}", quiet=quiet) as progress:
                summary, outcome = asyncio.run(_run_sweep(out, coord, journal, sweep_id=sweep_id,
                                                          grid_name=grid_name, workers=workers, join=join,
                                                          listen=listen, run_id=run_id, progress=progress))
                progress.finish(outcome)
        journal.close()
        c = coord.counts()
        typer.echo(f"sweep {sweep_id}: {outcome} in {time.monotonic() - t0:.1f}s; "
                   f"{c['done']}/{c['jobs']} jobs done, {c['unresolved']} unresolved, "
                   f"{c['checks']} spot checks ({c['waived']} waived), "
                   f"{c['banned']} peers banned")
        for peer, reason in coord.banned.items():
            typer.echo(f"  banned {peer}: {reason}")
        if summary is None:
            typer.echo("not finished; continue with: "
                       f"intellect-node sweep polysemanticity --out {out} --resume", err=True)
            raise typer.Exit(1 if outcome == "workers exited" else 130)
        typer.echo(research.table(summary))
        typer.echo(f"wrote {out / 'results.jsonl'}, {out / 'summary.json'}, {out / 'plot.png'}")

    @sweep.command("worker")
    def worker(
        data_dir_opt: Optional[Path] = DataDirOption,
        bootstrap: list[str] = typer.Option([], "--bootstrap", "-b",
                                            help="Peer to dial at start (repeatable)."),
        coordinator: list[str] = typer.Option([], "--coordinator", help="Only work for this coordinator's "
                                                                        "sweeps (peer ID, repeatable)."),
        run_id: str = typer.Option(SWEEP_RUN_ID, "--run-id",
                                   help="Run of the sweeps to work for (the coordinator's default too)."),
        listen: list[str] = typer.Option([], "--listen", "-l", help="libp2p listen multiaddr (repeatable)."),
        heartbeat_interval: Optional[float] = typer.Option(None, "--heartbeat-interval"),
        peer_timeout: Optional[float] = typer.Option(None, "--peer-timeout"),
        log_level: str = typer.Option("INFO", "--log-level"),
        log_file: Optional[Path] = typer.Option(None, "--log-file"),
    ) -> None:
        """Join the swarm as a sweep worker: claim jobs, train on one thread, return signed results."""
        from intellect_node.commands.join import build_node_config
        from intellect_node.errors import ProtocolError
        from intellect_node.logsetup import setup_logging
        from intellect_node.protocol.ids import public_key_from_peer_id

        d = data_dir(data_dir_opt)
        for c in coordinator:
            try:
                public_key_from_peer_id(c)
            except ProtocolError as exc:
                raise ConfigError(f"--coordinator {c!r} is not a peer ID (12D3KooW...)",
                                  field="coordinator") from exc
        cfg = build_node_config(listen=listen, bootstrap=bootstrap, run_id=run_id, trainer_peer_id=None,
                                http_host=None, http_port=0, http_public_url=None, control_port=0,
                                heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout)
        setup_logging(level=log_level, json_lines=True, file=log_file)
        from intellect_node.node.assembly import sweep_worker_node
        from intellect_node.node.runtime import run_node

        raise typer.Exit(run_node(sweep_worker_node(cfg, d, coordinators=set(coordinator))))

    app.add_typer(sweep, name="sweep")
