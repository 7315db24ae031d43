"""`stop`, `logs [-f]` and `config show` against real node processes and real files. The commands run in
this process (``tests.support.cli.invoke_cli``) but for `logs -f`, the installed console script ended with a
Ctrl-C."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

from intellect_node.commands.logs import PrivateRotatingFileHandler
from intellect_node.logsetup import JsonLinesFormatter
from tests.support.cli import invoke_cli
from tests.support.common import CLI, ctrl_c_reaches_child
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for


def _follower(*args: str, out: Path) -> subprocess.Popen[bytes]:
    """`intellect-node logs -f ...` writing to ``out`` (read by the test while it runs)."""
    with open(out, "wb") as f:
        return subprocess.Popen([CLI, "logs", "-f", *args], stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=ctrl_c_reaches_child)


def _end(proc: subprocess.Popen[bytes]) -> int:
    """Ctrl-C for the follower (by its PID): it exits 0. One that does not is killed, then the test fails."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise


def test_stop_logs_follow_and_not_running(tmp_path: Path) -> None:
    d = tmp_path / "a"
    node = NodeProcess(d)
    follower: subprocess.Popen[bytes] | None = None
    try:
        st = node.wait_ready()
        log = d / "node.log"
        # a headless node logs to stderr *and* to <data-dir>/node.log (JSON lines, 0600)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        records = [json.loads(ln) for ln in log.read_text().splitlines()]
        assert any(rec["msg"].startswith(f"node {st['peer_id']} up") for rec in records)
        r = invoke_cli("logs", "--data-dir", str(d), "-n", "3")
        assert r.returncode == 0, r.stderr
        assert 0 < len(r.stdout.splitlines()) <= 3 and "INFO" in r.stdout
        raw = invoke_cli("logs", "--data-dir", str(d), "-n", "1", "--json")
        assert json.loads(raw.stdout)["level"]

        out = tmp_path / "follow.txt"
        follower = started = _follower("--data-dir", str(d), "-n", "0", out=out)
        wait_for(lambda: started.poll() is None and out.exists(), 10, what="the follower started")

        r = invoke_cli("stop", "--data-dir", str(d))
        assert r.returncode == 0, r.stderr
        assert f"pid {node.pid}" in r.stdout and "control API" in r.stdout
        assert node.returncode == 0  # stop returned only after the node had exited, cleanly
        assert not (d / "control.json").exists()
        # what the node logged while stopping reached the follower, rendered for a person
        wait_for(lambda: "stopped in" in out.read_text(), 15, what="the follower printed the stop")
        assert "{" not in out.read_text().splitlines()[-1]
        assert _end(follower) == 0
        follower = None

        again = invoke_cli("stop", "--data-dir", str(d))
        assert again.returncode == 3 and "no node is running" in again.stderr
    finally:
        if follower is not None:
            follower.kill()
            follower.wait(10)
        node.close()


def test_stop_signals_a_node_without_control_api_and_clears_a_stale_control_file(tmp_path: Path) -> None:
    """A process holding the data-dir lock with no control API yet (a node still starting) gets SIGTERM by
    the PID that holds the lock; a control.json left by a killed node (lock free) is removed, exit 3."""
    d = tmp_path / "n"
    d.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); signal.pause()", str(d / "node.lock")],
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        r = invoke_cli("stop", "--data-dir", str(d), "--timeout", "30")
        assert r.returncode == 0, r.stderr
        assert "SIGTERM" in r.stdout and f"pid {holder.pid}" in r.stdout
        assert holder.wait(10) == -signal.SIGTERM
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)

    stale = {"url": "http://127.0.0.1:9", "token": "t", "pid": os.getpid()}
    (d / "control.json").write_text(json.dumps(stale))
    r = invoke_cli("stop", "--data-dir", str(d))
    assert r.returncode == 3 and "no node is running" in r.stderr
    assert not (d / "control.json").exists()


def test_logs_follow_survives_rotation_and_missing_log(tmp_path: Path) -> None:
    log_file = tmp_path / "rot" / "node.log"
    log_file.parent.mkdir()
    handler = PrivateRotatingFileHandler(log_file, maxBytes=400, backupCount=2, encoding="utf-8")
    handler.setFormatter(JsonLinesFormatter())
    logger = logging.getLogger("test.rotation")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = tmp_path / "follow.txt"
    try:
        logger.info("before-follow")
        follower = _follower("--file", str(log_file), "-n", "1", out=out)
        try:
            wait_for(lambda: "before-follow" in out.read_text(), 15, what="the last line")
            for i in range(20):  # about 100 bytes a line: a rotation every 4 lines
                logger.info("line-%02d", i)
                # one line at a time, as a node logs: a burst larger than the kept backups between two
                # looks would be rotated away before any reader (tail -F too) saw it
                wait_for(lambda: f"line-{i:02d}" in out.read_text(), 15, what=f"line {i} after rotations")
            assert (tmp_path / "rot" / "node.log.2").exists()
            assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
            seen = [ln.rsplit(": ", 1)[1] for ln in out.read_text().splitlines()]
            assert seen == ["before-follow"] + [f"line-{i:02d}" for i in range(20)]
        finally:
            assert _end(follower) == 0
    finally:
        logger.removeHandler(handler)
        handler.close()
    r = invoke_cli("logs", "--data-dir", str(tmp_path / "empty"))
    assert r.returncode == 2 and "no log at" in r.stderr and "--log-file" in r.stderr


def test_config_show_sources_and_round_trip(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[network]\nheartbeat_interval = 2.0\npeer_timeout = 30.0\n[run]\nrun_id = "from-file"\n')
    env = {"INTELLECT_NODE_NETWORK__HTTP_PORT": "5555", "INTELLECT_NODE_RUN__RUN_ID": "from-env"}
    r = invoke_cli("config", "show", "--data-dir", str(d), "--config", str(cfg), "--run-id", "from-flag",
                "--control-port", "7777", env=env)
    assert r.returncode == 0, r.stderr
    lines = {ln.split("=", 1)[0].strip("# ").strip(): ln for ln in r.stdout.splitlines() if "=" in ln}
    assert lines["heartbeat_interval"].endswith(f"# file {cfg}")
    assert lines["http_port"].endswith("# env INTELLECT_NODE_NETWORK__HTTP_PORT")
    assert lines["run_id"].startswith('run_id = "from-flag"') and lines["run_id"].endswith("# flag --run-id")
    assert lines["control_port"].endswith("# flag --control-port")
    assert lines["bootstrap"].endswith("# default")

    # the output is a config file: fed back with --config it gives the same values
    doc = tomllib.loads(r.stdout)
    assert doc["run"]["run_id"] == "from-flag" and doc["network"]["http_port"] == 5555
    back = tmp_path / "back.toml"
    back.write_text(r.stdout)
    j = invoke_cli("config", "show", "--data-dir", str(d), "--config", str(back), "--json")
    values = json.loads(j.stdout)["values"]
    assert values["run"]["run_id"] == "from-flag" and values["network"]["control_port"] == 7777
    assert json.loads(j.stdout)["origin"]["network.http_port"] == f"file {back}"

    # <data-dir>/config.toml is found like join finds it; a wrong flag value is refused like join does
    (d / "config.toml").write_text('[run]\nrun_id = "in-data-dir"\n')
    j = invoke_cli("config", "show", "--data-dir", str(d), "--json", env={"INTELLECT_NODE_CONFIG": ""})
    assert json.loads(j.stdout)["values"]["run"]["run_id"] == "in-data-dir"
    bad = invoke_cli("config", "show", "--data-dir", str(d), "--bootstrap", "/ip4/1.2.3.4/tcp/1")
    assert bad.returncode == 2 and "network.bootstrap" in bad.stderr and "--bootstrap" in bad.stderr
    unknown = invoke_cli("config", "show", "--data-dir", str(d), "--no-such-flag")
    assert unknown.returncode == 2 and "no-such-flag" in unknown.stderr
