"""A headless node as a process: JSON-lines logs, status + /metrics over HTTP, doctor against it,
SIGTERM -> exit 0 in bounded time with the ledger flushed."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from intellect_node.config.status import StatusSnapshot
from tests.support.cli import invoke_cli
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

HB = ["--heartbeat-interval", "0.5", "--peer-timeout", "2"]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body: bytes = resp.read()
        return body


def _peers_metric(metrics_url: str) -> float:
    for fam in text_string_to_metric_families(_get(metrics_url).decode()):
        for s in fam.samples:
            if s.name == "intellect_node_peers" and s.labels == {"role": "any"}:
                return s.value
    raise AssertionError("no intellect_node_peers sample")


def test_headless_node_status_metrics_doctor_and_sigterm(tmp_path: Path) -> None:
    a = NodeProcess(tmp_path / "a", *HB)
    b: NodeProcess | None = None
    try:
        st_a = a.wait_ready()
        b = NodeProcess(tmp_path / "b", "--bootstrap", st_a["listen_addrs"][0], *HB)
        b_addr = b.wait_ready()["listen_addrs"][0]
        metrics_url = st_a["metrics"]["metrics"]
        assert metrics_url.startswith("http://127.0.0.1:")
        wait_for(lambda: _peers_metric(metrics_url) >= 1, 20, what="A's /metrics counts B")

        # the token-free JSON status beside /metrics is the dashboard's snapshot
        snap = StatusSnapshot.from_json(_get(st_a["metrics"]["url"] + "/v1/status"))
        assert snap.identity.peer_id == st_a["peer_id"] and snap.state == "running"
        # the control API (token) carries the same snapshot and the ledger's summary
        st = a.cli_status()
        assert st["snapshot"]["identity"]["peer_id"] == st_a["peer_id"]
        assert st["ledger"]["batches_submitted"] == 0

        # doctor against the running node: its view, a real dial to B, and the clock against A's peers
        r = invoke_cli("doctor", "--data-dir", str(tmp_path / "a"), "--json", "--bootstrap", b_addr)
        checks = json.loads(r.stdout)
        node = next(c for c in checks if c["name"] == "node")
        assert node["status"] == "ok" and st_a["peer_id"] in node["detail"]
        boot = [c for c in checks if c["name"] == "bootstrap"]
        clock = [c for c in checks if c["name"] == "clock"]
        assert boot and all(c["status"] == "ok" for c in boot), checks
        assert clock and clock[0]["status"] == "ok" and "against" in clock[0]["detail"], checks

        # SIGTERM: clean stop, exit 0, control file gone, ledger closed (WAL folded into the file)
        a.signal(signal.SIGTERM)
        assert a.wait(30) == 0, a.log()
        assert not (tmp_path / "a" / "control.json").exists()
        assert (tmp_path / "a" / "ledger.sqlite").exists()
        assert not (tmp_path / "a" / "ledger.sqlite-wal").exists()
        lines = [ln for ln in a.log().splitlines() if ln.strip()]
        assert lines and all(json.loads(ln)["level"] for ln in lines[-20:]), lines[-5:]
        assert any("stopped in" in json.loads(ln)["msg"] for ln in lines)
    finally:
        a.close()
        if b is not None:
            b.close()
