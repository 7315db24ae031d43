"""Children forked from the warm server (``node/warmstart.py``) start as an exec'd child would: their own
PID, environment, working directory, session and output; exit codes and signals read as ``Popen``'s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from intellect_node.commands.stop import pid_alive
from intellect_node.node.processes import NodeProcess
from intellect_node.node.warmstart import WarmChild, WarmStarter
from tests.support.common import CLI, REPO
from tests.support.swarm import WARM
from tests.support.wait import wait_for

PROBE = [sys.executable, "-m", "tests.support.warm_probe"]


def _starter() -> WarmStarter:
    return WARM if WARM is not None else WarmStarter()  # one server a process: the tests' own


def _said(out: Path) -> dict[str, object]:
    first = out.read_text().splitlines()[0]
    said: dict[str, object] = json.loads(first)
    return said


def test_a_warm_child_gets_its_own_environment_directory_session_and_output(tmp_path: Path) -> None:
    out = tmp_path / "out.log"
    child = _starter().start([*PROBE, "3"], output=out, env={"PROBE": "given", "PATH": "/usr/bin"}, cwd=REPO,
                             new_session=True)
    assert child.wait(60) == 3 and child.returncode == 3
    said = _said(out)
    assert said["pid"] == child.pid and said["sid"] == child.pid  # a session of its own
    assert said["probe"] == "given" and said["cwd"] == str(REPO) and said["stdin"] == ""
    assert said["name"] == "__main__" and said["argv"] == [str(REPO / "tests/support/warm_probe.py"), "3"]
    assert out.read_text().splitlines()[1:] == ["bye"]  # its atexit handlers ran
    assert said["comm"] == "warm_probe"  # the name ps shows


def test_a_signalled_warm_child_reads_as_popen_does(tmp_path: Path) -> None:
    out = tmp_path / "out.log"
    child = _starter().start([*PROBE, "wait"], output=out, env={"PATH": "/usr/bin"}, cwd=REPO)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(60) == -signal.SIGKILL


def test_what_a_warm_child_can_run() -> None:
    assert WarmStarter.runs([CLI, "join"]) and WarmStarter.runs(PROBE)
    assert not WarmStarter.runs(["prlimit", "--nofile=512", CLI, "join"])
    assert not WarmStarter.runs(["/usr/bin/python3", "-m", "x"]) and not WarmStarter.runs([])
    with pytest.raises(ValueError, match="start it with Popen"):
        _starter().start(["ip", "netns", "exec", "x", CLI], output=Path("/dev/null"))


LEAVER = """
import sys
from pathlib import Path
from intellect_node.node.warmstart import WarmStarter
child = WarmStarter(preload=[]).start([sys.executable, "-m", "tests.support.warm_probe", "wait"],
                                      output=Path(sys.argv[1]), cwd=Path.cwd())
print(child.pid, flush=True)
"""


def test_a_parent_that_exits_leaves_no_warm_child_behind(tmp_path: Path) -> None:
    """As with an exec'd child: the parent's exit does not wait for the child (multiprocessing would join
    it), and the child gets SIGTERM when the server goes with the parent."""
    out = subprocess.run([sys.executable, "-c", LEAVER, str(tmp_path / "out.log")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    wait_for(lambda: not pid_alive(pid), 60, what="the warm child ended after its parent")


class _NoServer(WarmStarter):
    def start(self, argv: Sequence[str], *, output: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, new_session: bool = False, die_with_parent: bool = True) -> WarmChild:
        raise OSError("no forkserver here")


def test_a_node_process_whose_server_cannot_start_is_started_cold(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out.log"
    node = NodeProcess([*PROBE, "4"], tmp_path / "d", output=out, cwd=REPO, starter=_NoServer())
    assert node.wait(60) == 4
    assert "starting it cold" in caplog.text and _said(out)["pid"] == node.pid
