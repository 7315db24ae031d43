"""Progress on long work, through the CLI with stderr not a terminal (JSON lines): `blob put` (with
and without a node), `blob get` through to `--out` written and synced, an interrupted `blob get` that
leaves no traceback in node.log, `tasks solve-rates`; the terminal form renders the same phases; and
`scripts/setup.sh` prints one timed line per step, nothing when there is nothing to do. The commands run
in this process (``tests.support.cli.invoke_cli``) but for the interrupted get, the installed console
script killed with a Ctrl-C. One pair of node processes serves the blob commands and the start-up log's
checks; the interrupted get has a node of its own, with no peer to answer its provider lookup."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from intellect_node.commands.progress import Progress
from intellect_node.node import control
from intellect_node.protocol.ids import cid_from_digest
from tests.support.cli import invoke_cli
from tests.support.common import CLI, REPO, ctrl_c_reaches_child
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

KIB = 1024
EVERY_UPDATE = {"INTELLECT_NODE_PROGRESS_INTERVAL": "0"}
"""A line for every update: the test sees each step, not whichever ones a period let through."""


def progress_lines(stderr: str) -> list[dict[str, Any]]:
    return [rec for line in stderr.splitlines() if line.startswith("{")
            if "progress" in (rec := json.loads(line))]


def phases(lines: list[dict[str, Any]]) -> list[str]:
    """The phases in order, each once."""
    out: list[str] = []
    for rec in lines:
        if not out or out[-1] != rec["phase"]:
            out.append(rec["phase"])
    return out


def counts(lines: list[dict[str, Any]], phase: str) -> list[float]:
    return [rec["done"] for rec in lines if rec["phase"] == phase]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """Two nodes, ``b`` bootstrapped to ``a`` (metrics on): the blob commands' and the start-up log's."""
    root = tmp_path_factory.mktemp("pair")
    a = NodeProcess(root / "a", "--metrics-port", "0")
    b: NodeProcess | None = None
    try:
        addr = a.wait_ready()["listen_addrs"][0]
        b = NodeProcess(root / "b", "--bootstrap", addr)
        b.wait_ready()
        yield a, b
    finally:
        a.close()
        if b is not None:
            b.close()


def test_blob_put_and_get_report_each_phase_as_json_lines(pair: tuple[NodeProcess, NodeProcess],
                                                          tmp_path: Path) -> None:
    a, b = pair
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 * 1024 * KIB))
    put = invoke_cli("blob", "put", str(src), "--data-dir", str(a.data_dir), "--chunk-mib", "0.25",
                     env=EVERY_UPDATE)
    assert put.returncode == 0, put.stderr
    cid = put.stdout.strip()  # stdout holds the CID alone: `cid=$(intellect-node blob put f)` works
    assert cid.startswith("bafkrei") and len(put.stdout.splitlines()) == 1
    lines = progress_lines(put.stderr)
    assert {rec["progress"] for rec in lines} == {"blob put"}
    assert phases(lines) == ["chunking", "announcing in the DHT", "done"]
    chunked = counts(lines, "chunking")
    assert chunked == sorted(chunked) and chunked[-1] == src.stat().st_size and len(chunked) >= 12

    out = tmp_path / "out.bin"
    get = invoke_cli("blob", "get", cid, "--out", str(out), "--data-dir", str(b.data_dir),
                     env=EVERY_UPDATE)
    assert get.returncode == 0, get.stderr
    assert out.read_bytes() == src.read_bytes()
    lines = progress_lines(get.stderr)
    # after the last chunk: assembling --out, then its fsync, each shown (no silent wait)
    assert phases(lines) == ["finding providers", "fetching", "writing", "syncing to disk", "done"]
    fetched = counts(lines, "fetching")
    assert fetched == sorted(fetched) and fetched[-1] == src.stat().st_size
    written = counts(lines, "writing")
    assert written == sorted(written) and written[-1] < src.stat().st_size  # the last is "syncing"
    assert [r["out"] for r in lines if r["phase"] == "syncing to disk"] == [str(out)]

    # -q: the same work, no progress at all
    quiet = invoke_cli("blob", "get", cid, "--out", str(tmp_path / "q.bin"), "--data-dir",
                       str(b.data_dir), "-q")
    assert quiet.returncode == 0 and progress_lines(quiet.stderr) == [], quiet.stderr


def test_blob_put_without_a_node_reports_chunking(tmp_path: Path) -> None:
    d = tmp_path / "d"
    assert invoke_cli("keys", "init", "--data-dir", str(d)).returncode == 0
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(64 * KIB))
    r = invoke_cli("blob", "put", str(src), "--data-dir", str(d), "--chunk-mib", str(4 / 1024),
                   env=EVERY_UPDATE)
    assert r.returncode == 0, r.stderr
    lines = progress_lines(r.stderr)
    assert phases(lines) == ["chunking", "done"]
    assert counts(lines, "chunking") == [0, *range(4 * KIB, 64 * KIB + 1, 4 * KIB)]
    assert r.stdout.strip().startswith("bafkrei")


def test_an_interrupted_get_leaves_no_traceback_at_error_in_the_node_log(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "n")
    try:
        node.wait_ready()
        nobody_has = cid_from_digest(os.urandom(32))
        get = subprocess.Popen([CLI, "blob", "get", nobody_has, "--out", str(tmp_path / "o.bin"),
                                "--data-dir", str(tmp_path / "n")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_child)
        try:
            wait_for(lambda: nobody_has in _fetching(tmp_path / "n"), timeout=30,
                     what="the node to start fetching")
            get.send_signal(signal.SIGINT)  # Ctrl-C
            get.wait(timeout=30)
        finally:
            if get.poll() is None:
                get.kill()
                get.wait()
        # the node notices the closed stream and ends the fetch: long before its 30 s provider lookup
        wait_for(lambda: nobody_has not in _fetching(tmp_path / "n"), timeout=20,
                 what="the node to end the abandoned fetch")
        wait_for(lambda: "client went away" in _node_log(tmp_path / "n"), timeout=10,
                 what="the INFO line about the abandoned get")
        records = [json.loads(line) for line in _node_log(tmp_path / "n").splitlines() if line.strip()]
        bad = [r for r in records if r.get("level") in ("ERROR", "CRITICAL") or "Traceback" in json.dumps(r)]
        assert bad == [], bad
        gone = [r for r in records if "client went away" in r["msg"]]
        assert gone and gone[0]["level"] == "INFO"
        assert node.status()["peer_id"]  # and it keeps running
    finally:
        node.close()


def _fetching(d: Path) -> list[str]:
    """The blobs the node is fetching (its control API: a blob with no manifest yet is in no listing)."""
    fetching: list[str] = control.request(d, "GET", "/v1/blob/ls")["fetching"]
    return fetching


def _node_log(d: Path) -> str:
    path = d / "node.log"
    return path.read_text() if path.exists() else ""


def test_tasks_solve_rates_reports_problems_measured(tmp_path: Path) -> None:
    out = tmp_path / "rates.json"
    r = invoke_cli("tasks", "solve-rates", "--out", str(out), "--pool", "24", "--samples", "4",
                   env=EVERY_UPDATE)
    assert r.returncode == 0, r.stderr
    lines = progress_lines(r.stderr)
    assert phases(lines) == ["loading the model", "measuring", "done"]
    measured = counts(lines, "measuring")
    assert measured[0] == 0 and measured == sorted(measured) and measured[-1] == 24
    assert {rec["total"] for rec in lines if rec["phase"] == "measuring"} == {24}
    assert len(json.loads(out.read_text())) == 24


def test_on_a_terminal_the_phases_render_as_bars() -> None:
    screen = io.StringIO()
    with Progress("blob get", stream=screen, tty=True) as p:
        p.phase("fetching", total=4 * KIB * KIB, unit="bytes")
        p.update(KIB * KIB)
        p.phase("syncing to disk")
    text = screen.getvalue()
    assert "fetching" in text and "syncing to disk" in text and "4.0 MiB" in text
    assert "{" not in text  # no JSON lines on a terminal


def test_setup_prints_a_timed_line_per_step_and_nothing_when_done(tmp_path: Path) -> None:
    """A stand-in venv whose python records what pip was asked (the real install is `make setup`'s, and
    the package index is outside this machine)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    py = venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    py.chmod(0o755)
    env = {**os.environ, "VENV": str(venv)}
    first = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
    assert first.returncode == 0, first.stderr
    steps = first.stdout.splitlines()
    assert [s.split(" ...")[0] for s in steps[:3]] == [
        "setup: upgrading pip, wheel, setuptools",
        "setup: installing torch==2.13.0 (CPU wheel; minutes on a first install)",
        "setup: installing intellect-node and its dev extra"]
    assert all(s.endswith("s)") and " done (" in s for s in steps[:3])
    assert steps[3].startswith(f"setup: environment ready in {venv} (")
    assert "torch==2.13.0" in calls.read_text().splitlines()[1]
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == ""
    assert len(calls.read_text().splitlines()) == 3  # nothing installed the second time

    # a failing step says so on its line and stops the set-up
    (venv / ".installed").unlink()
    py.write_text("#!/bin/sh\nexit 3\n")
    failed = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert failed.returncode == 3 and failed.stdout.splitlines()[-1].endswith("FAILED (0s, exit 3)")


def test_start_up_log_status_and_dashboard_show_the_address_to_share_and_the_metrics_url(
        pair: tuple[NodeProcess, NodeProcess]) -> None:
    from rich.console import Console

    from intellect_node import dashboard
    from intellect_node.config.status import StatusSnapshot

    node = pair[0]
    d = node.data_dir
    st = node.wait_ready()
    share = st["listen_addrs"][0]
    assert share.startswith("/ip4/127.0.0.1/tcp/") and share.endswith(f"/p2p/{st['peer_id']}")
    url = st["metrics"]["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    up = [json.loads(line) for line in _node_log(d).splitlines() if " up: " in line]
    assert len(up) == 1 and f"--bootstrap {share}" in up[0]["msg"] and url in up[0]["msg"]

    human = invoke_cli("status", "--data-dir", str(d))
    assert human.returncode == 0, human.stderr
    assert f"metrics     {url}" in human.stdout and share in human.stdout

    snap = StatusSnapshot.from_json(json.dumps(st["snapshot"]))
    assert snap.identity.share_addr == share and snap.identity.metrics_url == url
    console = Console(record=True, width=80, height=24, force_terminal=True, file=io.StringIO())
    console.print(dashboard.render_node(snap))
    screen = console.export_text()
    assert len(screen.rstrip("\n").splitlines()) <= 24
    assert share in screen.replace("\n", "") and url in screen  # folded at 80 columns, never cut
