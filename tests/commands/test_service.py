"""`service install`: the unit it writes (ExecStart is this installation's program), the config it creates,
and `systemd-analyze verify` on the units (this machine has systemd 252's systemd-analyze)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

from intellect_node.commands.service import (
    SYSTEM_CONFIG,
    SYSTEM_DATA_DIR,
    UNIT_NAME,
    Plan,
    unit_text,
)
from tests.support.cli import invoke_cli
from tests.support.common import CLI, REPO

ANALYZE = shutil.which("systemd-analyze")


def _verify(unit: Path) -> str:
    """systemd-analyze's complaints about ``unit`` ("" when none). It exits 0 on some of them (an unknown
    value is "ignoring"), so the output is what counts. Without the tool the unit is parsed here instead."""
    if ANALYZE is None:
        return _structural(unit.read_text())
    r = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    return (r.stdout + r.stderr).strip() or ("" if r.returncode == 0 else f"exit {r.returncode}")


def _structural(text: str) -> str:
    sections: dict[str, dict[str, str]] = {}
    current = None
    for ln in text.splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        if ln.startswith("["):
            current = sections.setdefault(ln.strip("[]"), {})
        elif current is None or "=" not in ln:
            return f"bad line: {ln}"
        else:
            current[ln.split("=", 1)[0]] = ln.split("=", 1)[1]
    return "" if {"Unit", "Service", "Install"} <= set(sections) else f"sections: {sorted(sections)}"


def _exec_start(text: str) -> list[str]:
    return next(ln for ln in text.splitlines() if ln.startswith("ExecStart=")).split("=", 1)[1].split()


def test_user_install_writes_unit_and_config(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    data = tmp_path / "data"
    r = invoke_cli("service", "install", "--user", "--data-dir", str(data), "--role", "validator", env=env)
    assert r.returncode == 0, r.stderr
    unit = tmp_path / "cfg" / "systemd" / "user" / UNIT_NAME
    config = tmp_path / "cfg" / "intellect-node" / "config.toml"
    text = unit.read_text()
    argv = _exec_start(text)
    # the program of this installation, absolute: the console script the tests run
    assert argv[0] == CLI and Path(argv[0]).is_absolute()
    assert argv[1:] == ["join", "--headless", "--role", "validator", "--config", str(config)]
    assert f"Environment=INTELLECT_NODE_DATA_DIR={data}" in text and "WantedBy=default.target" in text
    assert "User=" not in text  # a user unit runs as the user
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    doc = tomllib.loads(config.read_text())
    assert doc["run"]["run_id"] == "default" and "network" in doc
    assert "systemctl --user enable --now intellect-node" in r.stdout
    assert _verify(unit) == ""

    # the config it wrote is one the node accepts; a second install keeps it and refuses to replace the unit
    shown = invoke_cli("config", "show", "--config", str(config), "--data-dir", str(data))
    assert shown.returncode == 0, shown.stderr
    again = invoke_cli("service", "install", "--user", "--data-dir", str(data), env=env)
    assert again.returncode == 2 and "--force" in again.stderr
    config.write_text('[run]\nrun_id = "mine"\n')
    assert invoke_cli("service", "install", "--user", "--force", env=env).returncode == 0
    assert config.read_text() == '[run]\nrun_id = "mine"\n'


def test_system_dry_run_and_the_documented_unit(tmp_path: Path) -> None:
    r = invoke_cli("service", "install", "--system", "--dry-run", "--config", str(tmp_path / "c.toml"))
    assert r.returncode == 0, r.stderr
    assert "would write /etc/systemd/system/intellect-node.service" in r.stderr
    assert not (tmp_path / "c.toml").exists()  # nothing written
    text = r.stdout
    assert "User=intellect-node" in text and "StateDirectory=intellect-node" in text
    assert "WantedBy=multi-user.target" in text and "Type=notify" in text and "WatchdogSec=45" in text
    assert _exec_start(text)[0] == CLI
    unit = tmp_path / UNIT_NAME
    unit.write_text(text)
    assert _verify(unit) == ""
    custom = invoke_cli("service", "install", "--system", "--dry-run", "--data-dir", "/srv/node")
    assert "ReadWritePaths=/srv/node" in custom.stdout and "StateDirectory" not in custom.stdout
    assert invoke_cli("service", "install", "--dry-run").returncode == 2  # --user or --system

    # docs/intellect-node.service is exactly what --system writes for an install in /opt/intellect-node
    plan = Plan(system=True, unit=Path("/etc/systemd/system") / UNIT_NAME, config=SYSTEM_CONFIG,
                data_dir=SYSTEM_DATA_DIR, program=["/opt/intellect-node/.venv/bin/intellect-node"],
                roles=("worker",))
    assert (REPO / "docs" / "intellect-node.service").read_text() == unit_text(plan)


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above means something: a unit with a bad value is reported."""
    r = invoke_cli("service", "install", "--system", "--dry-run")
    bad = tmp_path / UNIT_NAME
    bad.write_text(r.stdout.replace("Type=notify", "Type=bogus") if ANALYZE else "ExecStart=x\n")
    assert _verify(bad) != ""
