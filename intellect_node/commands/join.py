"""``intellect-node join``: run a node in the swarm until SIGINT/SIGTERM.

Flags map onto :class:`~intellect_node.node.config.NodeConfig`; a wrong flag exits 2 with the flag's
name and the fix. The services a node runs (blob store/HTTP today; roles later) are listed in
:func:`services`: that is the seam where other parts add themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError

FLAG_OF_FIELD = {
    "network.listen": "--listen", "network.bootstrap": "--bootstrap", "network.http_host": "--http-host",
    "network.http_port": "--http-port", "network.http_public_url": "--http-public-url",
    "network.control_port": "--control-port", "network.heartbeat_interval": "--heartbeat-interval",
    "network.peer_timeout": "--peer-timeout", "network": "--peer-timeout/--heartbeat-interval",
    "run.run_id": "--run-id", "run.trainer_peer_id": "--trainer-peer-id",
}


def services(runtime: Any) -> None:
    """Add the services every node runs to ``runtime`` (imported here, after argument parsing)."""
    from intellect_node.node.blob_service import BlobService

    runtime.add_service(lambda rt: BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board))


def build_node_config(*, listen: list[str], bootstrap: list[str], run_id: str | None,
                      trainer_peer_id: str | None, http_host: str | None, http_port: int,
                      http_public_url: str | None, control_port: int, heartbeat_interval: float | None,
                      peer_timeout: float | None) -> Any:
    """The config from flags; ConfigError names the flag (not the config field) on a mistake."""
    from intellect_node.node.config import build_config

    network: dict[str, Any] = {"bootstrap": bootstrap, "http_host": http_host, "http_port": http_port,
                               "http_public_url": http_public_url, "control_port": control_port}
    if listen:
        network["listen"] = listen
    if heartbeat_interval is not None:
        network["heartbeat_interval"] = heartbeat_interval
    if peer_timeout is not None:
        network["peer_timeout"] = peer_timeout
    elif heartbeat_interval is not None:
        network["peer_timeout"] = max(20.0, 4 * heartbeat_interval)
    run: dict[str, Any] = {"trainer_peer_id": trainer_peer_id}
    if run_id is not None:
        run["run_id"] = run_id
    try:
        return build_config(network=network, run=run)
    except ConfigError as exc:
        flag = FLAG_OF_FIELD.get(exc.field or "")
        if flag is None:
            raise
        msg = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"{flag}: {msg}", field=flag.lstrip("-")) from exc


def register(app: typer.Typer) -> None:
    @app.command("join")
    def join(
        data_dir_opt: Optional[Path] = DataDirOption,
        listen: list[str] = typer.Option(
            [], "--listen", "-l", help="libp2p listen multiaddr (repeatable). Default /ip4/127.0.0.1/tcp/0; "
                                       "use /ip4/0.0.0.0/tcp/4001 to be reachable from other machines."),
        bootstrap: list[str] = typer.Option(
            [], "--bootstrap", "-b", help="Peer to dial at start, /ip4/.../tcp/.../p2p/12D3KooW... (repeatable). "
                                          "If none answers, peers remembered from earlier runs are tried."),
        run_id: Optional[str] = typer.Option(None, "--run-id", help="Run to take part in (default: default)."),
        trainer_peer_id: Optional[str] = typer.Option(None, "--trainer-peer-id",
                                                      help="Peer ID of the run's trainer."),
        http_host: Optional[str] = typer.Option(None, "--http-host",
                                                help="Bind address of the bulk HTTP server."),
        http_port: int = typer.Option(0, "--http-port", help="Port of the bulk HTTP server (0: any free port)."),
        http_public_url: Optional[str] = typer.Option(None, "--http-public-url",
                                                      help="HTTP base URL to advertise to peers."),
        control_port: int = typer.Option(0, "--control-port", help="Port of the 127.0.0.1 control API."),
        heartbeat_interval: Optional[float] = typer.Option(None, "--heartbeat-interval",
                                                           help="Seconds between heartbeats (default 5)."),
        peer_timeout: Optional[float] = typer.Option(None, "--peer-timeout",
                                                     help="Seconds of silence before a peer is gone (default 20)."),
        headless: bool = typer.Option(False, "--headless", help="No dashboard; log lines only."),
        log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
        log_file: Optional[Path] = typer.Option(None, "--log-file", help="Write logs here instead of stderr."),
    ) -> None:
        """Join the swarm and run until Ctrl-C (SIGINT) or SIGTERM; exits 0 after a clean stop."""
        from intellect_node.logsetup import setup_logging

        d = data_dir(data_dir_opt)
        cfg = build_node_config(listen=listen, bootstrap=bootstrap, run_id=run_id,
                                trainer_peer_id=trainer_peer_id, http_host=http_host, http_port=http_port,
                                http_public_url=http_public_url, control_port=control_port,
                                heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout)
        setup_logging(level=log_level, json_lines=headless, file=log_file)
        from intellect_node.node.runtime import NodeRuntime, run_node

        runtime = NodeRuntime(cfg, d)
        services(runtime)
        raise typer.Exit(run_node(runtime))
