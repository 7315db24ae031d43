"""``intellect-node service install --user|--system``: a systemd unit that runs this installation.

What went wrong before this command: the documented unit pointed ``ExecStart`` at a fixed path, nothing
created ``/etc/intellect-node`` for the config, and nothing put the program where the unit looked. Here
the unit is written for the program that runs the command (the console script this interpreter installed,
resolved to an absolute path), the config directory is created and given a config file made from the
schema (every field, at its default) when none exists, and the ``systemctl`` commands are printed, not
run: enabling a service is the operator's decision.

``--system``: ``/etc/systemd/system/intellect-node.service``, config ``/etc/intellect-config/.toml``,
data in ``/var/lib/intellect-node`` (systemd's ``StateDirectory``), a ``intellect-node`` system user (the
``useradd`` line is printed). ``--user``: ``$XDG_CONFIG_HOME/systemd/user/`` (default ``~/.config``),
config ``$XDG_CONFIG_HOME/intellect-config/.toml``, the user's default data dir. ``--dry-run`` prints
the unit and the plan and writes nothing. ``docs/intellect-node.service`` is :func:`unit_text` for
``--system`` with the program in ``/opt/intellect-node/.venv`` (a test keeps them equal).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from intellect_node.errors import ConfigError

UNIT_NAME = "intellect-node.service"
SYSTEM_USER = "intellect-node"
SYSTEM_DATA_DIR = Path("/var/lib/intellect-node")
SYSTEM_CONFIG = Path("/etc/intellect-config/.toml")


@dataclass(frozen=True)
class Plan:
    """Where everything goes for one install."""

    system: bool
    unit: Path
    config: Path
    data_dir: Path
    program: list[str]
    roles: tuple[str, ...]


def program_argv() -> list[str]:
    """How systemd should start this installation: the ``intellect-node`` console script beside this
    interpreter (a venv's or pipx's bin/), else the script this process was started as, else
    ``python -m intellect_node.cli`` with this interpreter. Absolute, symlinks resolved only in the
    directory part (a venv's python is a symlink that must stay the venv's)."""
    beside = Path(sys.executable).with_name("intellect-node")
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside.absolute())]
    argv0 = Path(sys.argv[0])
    if argv0.name == "intellect-node" and argv0.is_file():
        return [str(argv0.resolve())]
    return [str(Path(sys.executable).absolute()), "-m", "intellect_node.cli"]


def unit_text(plan: Plan) -> str:
    """The unit file: a headless node under ``Type=notify`` with the watchdog (docs/operators.md)."""
    cmd = [*plan.program, "join", "--headless", *[a for r in plan.roles for a in ("--role", r)],
           "--config", str(plan.config)]
    exec_start = " ".join(shlex.quote(a) for a in cmd)
    how = "sudo systemctl" if plan.system else "systemctl --user"
    journal = "journalctl -u intellect-node -f" if plan.system else "journalctl --user -u intellect-node -f"
    lines = [
        "# systemd unit for a headless intellect-node, written by `intellect-node service install"
        f" {'--system' if plan.system else '--user'}`.",
        f"# Start:  {how} daemon-reload && {how} enable --now intellect-node",
        f"# Watch:  {journal}   (JSON lines; also in <data-dir>/node.log: `intellect-node logs -f`)",
        f"# Config: {plan.config} (INTELLECT_NODE_<SECTION>__<FIELD> variables below override it)",
        "# Docs:   docs/operators.md and docs/operating.md of the source tree",
        "#",
        "# SIGTERM (systemctl stop) stops the node cleanly within about 20 s (exit 0); TimeoutStopSec leaves",
        "# a margin. The node says READY=1 once up and WATCHDOG=1 only while libp2p answers and every",
        "# essential task runs; exit 75 (a part it could not keep working) and a watchdog kill are",
        "# restarted, exit 2 (a configuration mistake) is not.",
        "",
        "[Unit]",
        "Description=intellect-node: decentralized RL swarm node",
        "Wants=network-online.target",
        "After=network-online.target time-sync.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=45",
        "# Start-up loads the model and, for a returning node, its last policy: allow for a slow disk.",
        "TimeoutStartSec=300",
    ]
    if plan.system:
        lines += [f"User={SYSTEM_USER}", f"Group={SYSTEM_USER}"]
    lines += [
        f"Environment=INTELLECT_NODE_DATA_DIR={plan.data_dir}",
        "Environment=OMP_NUM_THREADS=1",
        "# Any config field can be overridden here, e.g.:",
        "# Environment=INTELLECT_NODE_NETWORK__BOOTSTRAP=/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW...",
        f"ExecStart={exec_start}",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=45",
        "Restart=on-failure",
        "RestartSec=10",
        "RestartPreventExitStatus=2",
        "# Peers, HTTP fetchers and servers each hold sockets: the default soft limit (1024) can be",
        "# reached by many connections at once, and then every accept and dial fails.",
        "LimitNOFILE=65536",
    ]
    if plan.system:
        lines += ["NoNewPrivileges=true", "ProtectSystem=strict", "ProtectHome=true", "PrivateTmp=true"]
        if plan.data_dir == SYSTEM_DATA_DIR:
            lines += ["StateDirectory=intellect-node", "StateDirectoryMode=0700"]
        else:
            lines += [f"ReadWritePaths={plan.data_dir}"]
    lines += ["", "[Install]", f"WantedBy={'multi-user.target' if plan.system else 'default.target'}", ""]
    return "\n".join(lines)


def make_plan(*, system: bool, config: Path | None, data_dir: Path | None, roles: list[str]) -> Plan:
    from intellect_node.p2p.identity import default_data_dir

    if system:
        unit = Path("/etc/systemd/system") / UNIT_NAME
        cfg = config or SYSTEM_CONFIG
        dd = data_dir or SYSTEM_DATA_DIR
    else:
        home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        unit = home / "systemd" / "user" / UNIT_NAME
        cfg = config or home / "intellect-node" / "config.toml"
        dd = data_dir or default_data_dir()
    return Plan(system=system, unit=unit, config=cfg.expanduser().absolute(),
                data_dir=dd.expanduser().absolute(), program=program_argv(), roles=tuple(roles))


def next_steps(plan: Plan) -> list[str]:
    if plan.system:
        return [f"sudo useradd --system --no-create-home --shell /usr/sbin/nologin {SYSTEM_USER}  "
                "# once, if the user does not exist",
                f"sudo chgrp {SYSTEM_USER} {plan.config} && sudo chmod 0640 {plan.config}",
                "sudo systemctl daemon-reload", "sudo systemctl enable --now intellect-node",
                "journalctl -u intellect-node -f",
                f"sudo -u {SYSTEM_USER} {plan.program[0]} status --data-dir {plan.data_dir}"]
    return ["systemctl --user daemon-reload", "systemctl --user enable --now intellect-node",
            "loginctl enable-linger \"$USER\"  # keep it running after you log out",
            "journalctl --user -u intellect-node -f",
            f"{plan.program[0]} status --data-dir {plan.data_dir}"]


def register(app: typer.Typer) -> None:
    service = typer.Typer(help="Run the node as a systemd service.", no_args_is_help=True)

    @service.command("install")
    def install(
        user: bool = typer.Option(False, "--user", help="A user unit (~/.config/systemd/user)."),
        system: bool = typer.Option(False, "--system",
                                    help="A system unit (/etc/systemd/system; needs root)."),
        config: Optional[Path] = typer.Option(None, "--config", "-c",
                                              help="Config file for the unit (created from the defaults if "
                                                   "missing)."),
        data_dir_opt: Optional[Path] = typer.Option(None, "--data-dir", "-d",
                                                    help="The node's data dir (default: "
                                                         "/var/lib/intellect-node for --system, the user "
                                                         "data dir for --user)."),
        role: list[str] = typer.Option(["worker"], "--role", help="RL role(s) the service runs."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the unit and the plan; write nothing."),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing unit file."),
    ) -> None:
        """Write a systemd unit for this installation and a config file if missing; print the commands
        that enable it."""
        from intellect_node.config import example_toml
        from intellect_node.fsutil import atomic_write_text

        if user == system:
            raise ConfigError("give exactly one of --user or --system", field="mode")
        plan = make_plan(system=system, config=config, data_dir=data_dir_opt, roles=role)
        text = unit_text(plan)
        if dry_run:
            typer.echo(text)
            typer.echo(f"# would write {plan.unit}" + ("" if plan.config.exists() else
                                                       f" and create {plan.config}"), err=True)
            return
        if plan.unit.exists() and not force:
            raise ConfigError(f"{plan.unit} exists; pass --force to replace it", field="force")
        try:
            if not plan.config.exists():
                plan.config.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                atomic_write_text(plan.config, example_toml() + "\n", mode=0o640 if system else 0o600)
                typer.echo(f"created {plan.config} (every field at its default: set network.listen and "
                           "network.bootstrap)")
            plan.unit.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(plan.unit, text, mode=0o644)
        except PermissionError as exc:
            raise ConfigError(f"cannot write {exc.filename} ({exc.strerror}); --system needs root (sudo "
                              f"{plan.program[0]} service install --system)", field="mode") from exc
        typer.echo(f"wrote {plan.unit} (ExecStart: {plan.program[0]})")
        typer.echo("next:")
        for step in next_steps(plan):
            typer.echo(f"  {step}")

    app.add_typer(service, name="service")
