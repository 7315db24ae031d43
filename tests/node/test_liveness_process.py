"""Liveness of a real ``intellect-node join`` process (through tests/support/liveness.py, which breaks
libp2p on a signal): a killed libp2p comes back and ``status --json``, ``/v1/status`` and ``/metrics``
say what happened; one that cannot come back makes the process exit 75 within 30 s, degraded meanwhile.
The ``status`` commands run in this process (``tests.support.cli``); the node is the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from intellect_node.p2p.liveness import EXIT_UNHEALTHY
from tests.support.cli import invoke_cli
from tests.support.common import REPO
from tests.support.ports import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
LAUNCHER = str(REPO / "tests" / "support" / "liveness.py")




def _status(data_dir: Path) -> dict[str, Any]:
    from intellect_node.node import control

    status: dict[str, Any] = control.request(data_dir, "GET", "/v1/status", timeout=5.0)
    return status


def _try_status(data_dir: Path) -> dict[str, Any] | None:
    try:
        return _status(data_dir)
    except Exception:  # not up yet, or stopping
        return None


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_libp2p_restart_is_reported_and_an_unrestorable_one_exits_75(tmp_path: Path) -> None:
    d = tmp_path / "node"
    port = free_port()
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, LAUNCHER, "join", "--data-dir", str(d), "--headless",
                                 "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--heartbeat-interval", "1"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        st = wait_for(lambda: (d / "control.json").exists() and _try_status(d), 60, what="node up")
        assert st  # wait_for's value is the predicate's, truthy: the status
        assert st["health"]["state"] in ("running", "degraded") and st["health"]["restarts"] == {}

        # 1. libp2p's thread dies; the node restarts it on the same port and says so everywhere
        proc.send_signal(signal.SIGUSR2)
        st = wait_for(lambda: (s := _try_status(d)) and s["health"]["restarts"].get("libp2p") == 1 and s,
                      30, what="libp2p restarted")
        assert st
        assert st["listen_addrs"][0].startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/")
        out = invoke_cli("status", "--data-dir", str(d), "--json")
        assert out.returncode == 0, out.stderr
        health = json.loads(out.stdout)["health"]
        assert not any("libp2p" in r for r in health["reasons"]), health
        assert any("the libp2p thread ended: InjectedFault: injected by the test" in w
                   for w in health["warnings"]), health
        assert any("libp2p restarted" in w for w in health["warnings"]), health
        m = _metrics(st["metrics"]["metrics"])
        assert m[("intellect_node_restarts_total", (("part", "libp2p"),))] == 1
        assert m[("intellect_node_status_age_seconds", ())] < 5
        with urllib.request.urlopen(st["metrics"]["url"] + "/v1/status", timeout=5) as resp:
            snap = json.loads(resp.read())
        assert any("InjectedFault" in w["message"] for w in snap["warnings"])

        # 2. it dies again and this time the port is taken: degraded while it retries, then exit 75
        proc.send_signal(signal.SIGUSR1)
        t0 = time.monotonic()
        st = wait_for(lambda: (s := _try_status(d)) and s["health"]["state"] == "degraded"
                      and any("libp2p restarting" in r for r in s["health"]["reasons"]) and s,
                      15, what="degraded while restarting")
        assert st
        assert st["snapshot"]["state"] == "degraded" and st["snapshot"]["healthy"] is False
        m = _metrics(st["metrics"]["metrics"])
        assert m[("intellect_node_healthy", ())] == 0
        out = invoke_cli("status", "--data-dir", str(d))
        assert out.returncode == 0, out
        assert out.stdout.startswith("state       DEGRADED\n            - libp2p restarting"), out.stdout
        code = proc.wait(60)
        elapsed = time.monotonic() - t0
        text = log_path.read_text()
        assert code == EXIT_UNHEALTHY, text[-3000:]
        assert elapsed < 30, f"exited after {elapsed:.1f}s"  # the bound, not a benchmark
        assert "could not be restarted" in text and "port" in text and "already in use" in text
        assert not (d / "control.json").exists()  # a clean stop on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
