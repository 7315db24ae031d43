"""node.processes, the one supervisor of child nodes: real child processes, ended by the PIDs we hold.

A child that exits early is reported with its code and last output; stop_all SIGTERMs every child, then
SIGKILLs the ones that ignore it after the grace period; a child outlives no parent killed with SIGKILL
(PR_SET_PDEATHSIG); the config file it writes is the one the node loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.config import load_config
from intellect_node.errors import IntellectNodeError
from intellect_node.node.processes import NodeProcess, child_env, die_with_parent, stop_all, write_config
from tests.support.wait import wait_for

PY = sys.executable
IGNORES_TERM = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(120)\n")
STOPS_ON_TERM = "import sys, time\nprint('ready', flush=True)\ntime.sleep(120)\n"


def _child(tmp: Path, name: str, code: str) -> NodeProcess:
    d = tmp / name
    return NodeProcess([PY, "-c", code], d, output=tmp / f"{name}.out")


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (the container's init need not reap re-parented children)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_child_that_exits_early_is_reported_with_its_code_and_output(tmp_path: Path) -> None:
    node = _child(tmp_path, "early", "import sys\nprint('no config here', flush=True)\nsys.exit(3)\n")
    with pytest.raises(IntellectNodeError, match="exited with code 3") as err:
        node.wait_ready(60)
    assert "no config here" in str(err.value) and str(node.data_dir) in str(err.value)
    assert not node.alive() and node.returncode == 3
    assert (tmp_path / "early.out").stat().st_mode & 0o777 == 0o600  # logs name peers and addresses


def test_stop_all_terms_every_child_and_kills_the_one_that_ignores_it(tmp_path: Path) -> None:
    polite = _child(tmp_path, "polite", STOPS_ON_TERM)
    stubborn = _child(tmp_path, "stubborn", IGNORES_TERM)
    try:
        for node in (polite, stubborn):
            wait_for(lambda: "ready" in node.output_text(), timeout=60, what=f"{node.name} to start")
        codes = stop_all([polite, stubborn], grace=2.0)
        assert codes == [-signal.SIGTERM, None]  # None: it had to be killed
        assert not polite.alive() and not stubborn.alive()
        assert stubborn.proc.returncode == -signal.SIGKILL
    finally:
        for node in (polite, stubborn):
            node.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_does_not_outlive_a_parent_killed_with_sigkill(tmp_path: Path) -> None:
    assert die_with_parent() is not None
    parent_code = ("import sys, time\nfrom pathlib import Path\n"
                   "from intellect_node.node.processes import NodeProcess\n"
                   "d = Path(sys.argv[1])\n"
                   "sleeper = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
                   "child = NodeProcess(sleeper, d, output=d / 'out')\n"
                   "print(child.pid, flush=True)\ntime.sleep(120)\n")
    parent = subprocess.Popen([PY, "-c", parent_code, str(tmp_path / "child")], stdout=subprocess.PIPE,
                              text=True)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid)
        os.kill(parent.pid, signal.SIGKILL)  # no clean-up runs in the parent
        parent.wait(30)
        wait_for(lambda: _gone(child_pid), timeout=30, what="the orphaned child to get SIGTERM")
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait(30)
        if child_pid and not _gone(child_pid):  # our grandchild, by the PID it reported
            os.kill(child_pid, signal.SIGKILL)


def test_the_config_file_written_is_the_one_the_node_loads(tmp_path: Path) -> None:
    path = write_config(tmp_path / "config.toml", {
        "network": {"listen": ["/ip4/127.0.0.1/tcp/0"], "heartbeat_interval": 1.0},
        "metrics": {"enabled": False},
        "run": {"run_id": "r1", "validator_peer_ids": [], "async_level": 3},
        "validator": {}})
    cfg = load_config(path, environ={})
    assert cfg.network.listen == ["/ip4/127.0.0.1/tcp/0"] and cfg.network.heartbeat_interval == 1.0
    assert cfg.metrics.enabled is False and cfg.run.run_id == "r1" and cfg.run.async_level == 3


def test_child_env_leaves_out_the_operators_settings_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTELLECT_NODE_RUN__RUN_ID", "operator's")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    kept = child_env()
    clean = child_env({"PYTHONUNBUFFERED": "1"}, drop_prefix="INTELLECT_NODE_")
    assert kept["INTELLECT_NODE_RUN__RUN_ID"] == "operator's" and kept["OMP_NUM_THREADS"] == "1"
    assert "INTELLECT_NODE_RUN__RUN_ID" not in clean and clean["PYTHONUNBUFFERED"] == "1"
    assert clean["PATH"] == os.environ["PATH"]



def test_restart_runs_the_same_command_again_and_appends_its_output(tmp_path: Path) -> None:
    node = _child(tmp_path, "again", "import os\nprint('run', os.getpid(), flush=True)\n")
    wait_for(lambda: not node.alive(), timeout=60, what="the first run to end")
    first = node.pid
    node.restart()
    wait_for(lambda: not node.alive(), timeout=60, what="the second run to end")
    assert node.output_text().split() == ["run", str(first), "run", str(node.pid)] and node.pid != first
    assert node.returncode == 0


def test_a_running_child_is_never_started_twice(tmp_path: Path) -> None:
    node = _child(tmp_path, "busy", STOPS_ON_TERM)
    try:
        wait_for(lambda: "ready" in node.output_text(), timeout=60, what="the child to start")
        with pytest.raises(IntellectNodeError, match="still runs"):
            node.restart()
    finally:
        stop_all([node], grace=2.0)
