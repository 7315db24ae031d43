"""``intellect-node join``: run a node in the swarm until SIGINT/SIGTERM.

Flags map onto :class:`~intellect_node.config.NodeConfig` and override ``--config FILE`` and
``INTELLECT_NODE_<SECTION>__<FIELD>`` variables; a wrong value exits 2 naming the field, where it was set
(flag, variable or file) and the fix. What the node runs (the common services and its ``--role`` s) is put
together by :mod:`intellect_node.node.assembly`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from intellect_node.commands.common import (
    BootstrapOption,
    DataDirOption,
    ListenOption,
    LogFileOption,
    LogLevelOption,
    NodeConfigOption,
    data_dir,
)
from intellect_node.commands.logs import NODE_LOG
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig
    from intellect_node.node.runtime import NodeRuntime

FLAG_OF_FIELD = {
    "network.listen": "--listen", "network.announce": "--announce", "network.bootstrap": "--bootstrap",
    "network.http_host": "--http-host",
    "network.http_port": "--http-port", "network.http_public_url": "--http-public-url",
    "network.control_port": "--control-port", "network.heartbeat_interval": "--heartbeat-interval",
    "network.peer_timeout": "--peer-timeout", "network": "--peer-timeout/--heartbeat-interval",
    "run.run_id": "--run-id", "run.trainer_peer_id": "--trainer-peer-id",
    "run.validator_peer_ids": "--validator-peer-id", "metrics.port": "--metrics-port",
}


def build_node_config(*, listen: list[str], bootstrap: list[str], run_id: str | None,
                      announce: list[str] | None = None,
                      trainer_peer_id: str | None, http_host: str | None, http_port: int | None,
                      http_public_url: str | None, control_port: int | None, heartbeat_interval: float | None,
                      peer_timeout: float | None, config_file: Path | None = None,
                      data_dir: Path | None = None, validator_peer_ids: list[str] | None = None,
                      metrics_port: int | None = None) -> NodeConfig:
    """The config: ``--config`` file < ``INTELLECT_NODE_*`` environment < the flags actually given.
    A mistake raises ConfigError naming the field and where it was set (the flag, variable or file)."""
    from intellect_node.config import load_config

    flags = join_flags(listen=listen, bootstrap=bootstrap, run_id=run_id, announce=announce,
                       trainer_peer_id=trainer_peer_id, http_host=http_host, http_port=http_port,
                       http_public_url=http_public_url, control_port=control_port,
                       heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout,
                       validator_peer_ids=validator_peer_ids, metrics_port=metrics_port)
    return load_config(config_file, flags=flags, data_dir=data_dir, flag_names=FLAG_OF_FIELD)


def join_flags(*, listen: list[str], bootstrap: list[str], run_id: str | None,
               announce: list[str] | None = None, trainer_peer_id: str | None, http_host: str | None,
               http_port: int | None, http_public_url: str | None, control_port: int | None,
               heartbeat_interval: float | None, peer_timeout: float | None,
               validator_peer_ids: list[str] | None = None, metrics_port: int | None = None,
               **_ignored: object) -> dict[str, object]:
    """The config layer of the flags actually given (``{"network": {...}, "run": {...}}``); also what
    ``config show`` passes the loader, so it reports a flag's value exactly as ``join`` would take it.
    ``_ignored``: join's other parameters (``--role``, ``--headless``...), which are not configuration."""
    given = {"listen": listen or None, "announce": announce or None, "bootstrap": bootstrap or None,
             "http_host": http_host, "http_port": http_port, "http_public_url": http_public_url,
             "control_port": control_port,
             "heartbeat_interval": heartbeat_interval, "peer_timeout": peer_timeout}
    network: dict[str, object] = {k: v for k, v in given.items() if v is not None}
    if peer_timeout is None and heartbeat_interval is not None:
        network["peer_timeout"] = max(20.0, 4 * heartbeat_interval)
    run = {k: v for k, v in {"run_id": run_id, "trainer_peer_id": trainer_peer_id,
                             "validator_peer_ids": validator_peer_ids or None}.items() if v is not None}
    metrics = {"port": metrics_port} if metrics_port is not None else {}
    return {k: v for k, v in {"network": network, "run": run, "metrics": metrics}.items() if v}


def _log_to_data_dir(d: Path, level: str, *, also_stderr: bool) -> None:
    """Logs into ``<data-dir>/node.log`` (JSON lines, rotated: what ``intellect-node logs`` reads) and,
    for a headless node, to stderr too (the journal under systemd). With the dashboard the file is the
    only place: the dashboard owns the screen and shows the WARNINGs itself."""
    import logging

    from intellect_node.commands.logs import node_log_handler
    from intellect_node.logsetup import setup_logging

    file_handler = node_log_handler(d)
    root = logging.getLogger()
    if also_stderr:
        first = setup_logging(level=level, json_lines=True)
    else:
        # setup_logging sets the levels (root, library noise) and opens a plain file handler; the
        # rotating one takes that handler's place.
        first = setup_logging(level=level, json_lines=True, file=d / NODE_LOG)
        root.removeHandler(first)
        first.close()
        file_handler._intellect_node = True  # type: ignore[attr-defined]  # a later setup_logging replaces it
    for flt in first.filters:  # whatever setup_logging filters (library noise) is filtered here the same
        file_handler.addFilter(flt)
    root.addHandler(file_handler)


def _dashboard(runtime: NodeRuntime) -> Callable[[], None]:
    """Start the dashboard in a thread, rendering ``runtime.board``; returns a function that stops it
    (and waits, so the terminal is restored before the process exits)."""
    import threading

    from intellect_node import dashboard

    stop = threading.Event()
    thread = threading.Thread(target=dashboard.run, args=(lambda: [runtime.board.snapshot()], stop),
                              kwargs={"footer": "Ctrl-C stops the node · logs in "
                                                f"{runtime.data_dir / NODE_LOG}"},
                              name="dashboard", daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(timeout=5)
    return close


def register(app: typer.Typer) -> None:
    @app.command("join")
    def join(
        data_dir_opt: Optional[Path] = DataDirOption,
        listen: list[str] = ListenOption,
        bootstrap: list[str] = BootstrapOption,
        announce: list[str] = typer.Option(
            [], "--announce", help="Multiaddr to advertise instead of the listen addresses, e.g. your public "
                                   "IP or a port forward (repeatable)."),
        run_id: Optional[str] = typer.Option(None, "--run-id",
                                             help="Run to take part in (default: default)."),
        trainer_peer_id: Optional[str] = typer.Option(None, "--trainer-peer-id",
                                                      help="Peer ID of the run's trainer."),
        role: list[str] = typer.Option(
            [], "--role", help="RL role to run: worker, validator or trainer (repeatable). Settings in the "
                               "rl config section or INTELLECT_NODE_RL__<FIELD>; see docs/training.md."),
        validator_peer_id: list[str] = typer.Option(
            [], "--validator-peer-id", help="Peer ID of a validator whose verdicts the trainer trusts "
                                            "(repeatable)."),
        http_host: Optional[str] = typer.Option(None, "--http-host",
                                                help="Bind address of the bulk HTTP server."),
        http_port: Optional[int] = typer.Option(None, "--http-port",
                                                help="Port of the bulk HTTP server (0: any free port)."),
        http_public_url: Optional[str] = typer.Option(None, "--http-public-url",
                                                      help="HTTP base URL to advertise to peers."),
        control_port: Optional[int] = typer.Option(None, "--control-port",
                                                   help="Port of the 127.0.0.1 control API."),
        metrics_port: Optional[int] = typer.Option(None, "--metrics-port",
                                                   help="Port of the 127.0.0.1 Prometheus /metrics server "
                                                        "(default 29464; 0: any free port)."),
        heartbeat_interval: Optional[float] = typer.Option(None, "--heartbeat-interval",
                                                           help="Seconds between heartbeats (default 5)."),
        peer_timeout: Optional[float] = typer.Option(None, "--peer-timeout",
                                                     help="Seconds of silence before a peer is gone "
                                                          "(default 20)."),
        config_file: Optional[Path] = NodeConfigOption,
        headless: bool = typer.Option(False, "--headless", help="No dashboard; log lines only (JSON lines)."),
        log_level: str = LogLevelOption,
        log_file: Optional[Path] = LogFileOption,
        run: Optional[str] = typer.Option(None, "--run", help="Join the run with this CID (or run ID): its "
                                          "signed manifest, model and thresholds are fetched through the "
                                          "swarm by their hashes (`intellect-node runs` lists runs)."),
        organiser: Optional[str] = typer.Option(None, "--organiser", help="With --run: the peer ID that "
                                                "must have signed the run."),
    ) -> None:
        """Join the swarm and run until Ctrl-C (SIGINT) or SIGTERM; exits 0 after a clean stop, 75 when
        it stopped because libp2p or an essential task could not be kept working (restart it), 2 on a
        configuration mistake.

        On a terminal it shows the dashboard (logs go to <data-dir>/node.log); with --headless, or when
        output is not a terminal, it logs JSON lines to stderr (or --log-file).
        """
        d = data_dir(data_dir_opt)
        if organiser is not None and run is None:
            raise ConfigError("--organiser pins who signed a run: give --run CID with it",
                              field="--organiser")
        if run is not None:
            flags = join_flags(listen=listen, bootstrap=bootstrap, run_id=run_id, announce=announce,
                               trainer_peer_id=trainer_peer_id, http_host=http_host, http_port=http_port,
                               http_public_url=http_public_url, control_port=control_port,
                               heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout,
                               validator_peer_ids=validator_peer_id, metrics_port=metrics_port)
            raise typer.Exit(run_node_for(d, run=run, organiser=organiser, roles=role, flags=flags,
                                          config_file=config_file, log_file=log_file, log_level=log_level,
                                          headless=headless))
        cfg = build_node_config(listen=listen, bootstrap=bootstrap, run_id=run_id, announce=announce,
                                trainer_peer_id=trainer_peer_id, http_host=http_host, http_port=http_port,
                                http_public_url=http_public_url, control_port=control_port,
                                heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout,
                                config_file=config_file, data_dir=d, validator_peer_ids=validator_peer_id,
                                metrics_port=metrics_port)
        raise typer.Exit(start_node(cfg, d, role, headless=headless, log_file=log_file, log_level=log_level))


def run_node_for(d: Path, *, run: str, organiser: str | None, roles: list[str], flags: Mapping[str, object],
                 config_file: Path | None, log_file: Path | None, log_level: str, headless: bool) -> int:
    """``join --run`` (and ``run publish``): the run's configuration from its manifest
    (``commands/runs.config_for_run``: fetched and checked), then the node as :func:`start_node` runs it.
    A run that cannot be had (bad signature, forged field, a CID nobody serves) exits 1 with why."""
    from intellect_node.commands.runs import config_for_run, fail
    from intellect_node.errors import IntellectNodeError

    try:
        cfg = config_for_run(run, organiser, d, flags=flags, config_file=config_file,
                             flag_names=FLAG_OF_FIELD)
    except ConfigError:
        raise
    except IntellectNodeError as exc:
        fail(exc)
        raise  # fail() exits; this keeps the type checker's flow honest
    return start_node(cfg, d, roles, headless=headless, log_file=log_file, log_level=log_level)


def start_node(cfg: NodeConfig, d: Path, roles: list[str], *, headless: bool, log_file: Path | None,
               log_level: str) -> int:
    """Log as asked, build the node (its memory check refuses a role that does not fit), run it until it
    stops; the exit code."""
    import sys

    from intellect_node.logsetup import setup_logging

    show_dashboard = not headless and sys.stdout.isatty()
    if log_file is not None:
        setup_logging(level=log_level, json_lines=headless or not show_dashboard, file=log_file)
    else:
        _log_to_data_dir(d, log_level, also_stderr=not show_dashboard)
    import logging

    from intellect_node.config.status import BoardLogHandler
    from intellect_node.node.assembly import build_node
    from intellect_node.node.runtime import run_node

    runtime = build_node(cfg, d, roles=roles)  # a wrong --role fails here, before anything starts
    # WARNING+ records reach the status snapshot whether or not a dashboard shows it: a headless
    # node's `status --json` and /v1/status carry them (not only the dashboard's panel).
    logging.getLogger().addHandler(BoardLogHandler(runtime.board))
    if show_dashboard:
        close_dashboard = _dashboard(runtime)
        try:
            return run_node(runtime)
        finally:
            close_dashboard()
    return run_node(runtime)
