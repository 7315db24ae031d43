"""``intellect-node audit calibrate``: the run's audit tolerance from honest replays under the auditor's
condition (here two torch threads against the trainer's one, on the embedded model), and operator
mistakes refused with the flag named (exit 2 through the console script)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from intellect_node.cli import app
from intellect_node.errors import ConfigError
from tests.support.cli import invoke_cli


def test_calibrate_prints_and_writes_the_tolerance(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    res = CliRunner().invoke(app, ["audit", "calibrate", "--threads", "2", "--steps", "1", "--out", str(out)])
    assert res.exit_code == 0, (res.stdout, res.exception)
    doc = json.loads(out.read_text())
    weights, moments = doc["weights"], doc["optimizer"]
    assert weights["steps"] == moments["steps"] == 1
    assert "1 thread(s) -> cpu, 2 thread(s)" in weights["condition"]
    # Rounding, not a different step: far below a learning rate 10% off (0.09 of the update).
    assert 0.0 <= weights["observed"] < 1e-2 and 0.0 <= moments["observed"] < 1e-2
    for c in (weights, moments):
        assert c["tolerance"] == pytest.approx(c["observed"] * 4.0 + 1e-5)
    assert doc["audit_tolerance"] == max(weights["tolerance"], moments["tolerance"])
    assert f"audit_tolerance = {doc['audit_tolerance']:.6g}" in res.stdout


@pytest.mark.parametrize(("args", "flag"), [
    (["--threads", "0"], "--threads"),
    (["--threads", "2", "--steps", "0"], "--steps"),
    (["--threads", "2", "--trainer-threads", "0"], "--trainer-threads"),
    (["--threads", "2", "--factor", "0.5"], "--factor"),
    (["--threads", "2", "--floor", "-1"], "--floor"),
    (["--threads", "2", "--config", "/nonexistent/node.toml"], "--config"),
    (["--threads", "2", "--out", "/nonexistent/dir/audit.json"], "--out"),
])
def test_operator_mistakes_name_the_flag(args: list[str], flag: str) -> None:
    res = CliRunner().invoke(app, ["audit", "calibrate", *args])
    assert isinstance(res.exception, ConfigError), res.stdout
    assert res.exception.field == flag and flag in str(res.exception)


def test_console_script_exits_2() -> None:
    r = invoke_cli("audit", "calibrate", "--threads", "0")
    assert r.returncode == 2 and "--threads" in r.stderr
