"""`intellect-node doctor`: each check explains the problem and the fix; exit 1 only when one failed."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from intellect_node.commands import doctor
from intellect_node.commands.checks import FAIL, OK, SKIP, WARN
from tests.support.cli import invoke_cli


def _by_name(checks: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for c in checks:
        out.setdefault(c["name"], []).append(c)
    return out


def test_offline_checks_on_a_fresh_data_dir(data_dir: Path) -> None:
    checks = _by_name([asdict(c) for c in doctor.run_checks(data_dir, config_file=None, bootstrap=[],
                                                             network=False)])
    assert checks["config"][0]["status"] == "ok"
    assert checks["data dir"][0]["status"] == "ok" and checks["disk space"][0]["status"] in ("ok", "warn")
    assert checks["node key"][0]["status"] == "warn" and "keys init" in checks["node key"][0]["fix"]
    assert checks["node"][0]["status"] == "skip"
    assert checks["listen"][0]["status"] == "warn" and "0.0.0.0" in checks["listen"][0]["fix"]
    assert checks["torch"][0]["status"] == "ok" and "bootstrap" not in checks
    bad = data_dir / "bad.toml"
    bad.write_text("[network]\nhttp_port = -1\n")
    cfg = doctor.run_checks(data_dir, config_file=bad, bootstrap=[], network=False)[0]
    assert cfg.status == FAIL and "network.http_port" in cfg.detail


def test_cli_text_and_json_and_exit_code(data_dir: Path) -> None:
    """Through the real entry point: a key readable by others fails with the chmod fix, exit 1."""
    assert invoke_cli("keys", "init", "--data-dir", str(data_dir)).returncode == 0
    os.chmod(data_dir / "node.key", 0o644)
    r = invoke_cli("doctor", "--data-dir", str(data_dir), "--offline", "--json")
    assert r.returncode == 1, r.stderr
    key = _by_name(json.loads(r.stdout))["node key"][0]
    assert key["status"] == "fail" and "chmod 600" in key["fix"]


def test_listen_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        checks = doctor.check_listen([f"/ip4/127.0.0.1/tcp/{port}"], node_running=False)
    fails = [c for c in checks if c.status == FAIL]
    assert fails and "ss -ltnp" in fails[0].fix and str(port) in fails[0].detail
    assert all(c.status != FAIL for c in doctor.check_listen(["/ip4/127.0.0.1/tcp/0"], False))
    assert doctor.check_listen(["/ip4/0.0.0.0/tcp/0"], False)[0].status == WARN


def test_model_dtype_and_thresholds(tmp_path: Path) -> None:
    m = tmp_path / "model"
    m.mkdir()
    for f in ("model.safetensors", "tokenizer.json"):
        (m / f).write_bytes(b"x")
    (m / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    checks = doctor.check_model(str(m), "float32")
    assert checks[0].status == OK and "stored float32" in checks[0].detail
    assert checks[1].status == WARN and "calibrate" in checks[1].fix
    (m / "proof_thresholds.json").write_text(
        json.dumps({"float32": {"exp_mismatches": 2, "mant_err_mean": 0.5}}))
    assert "exp_mismatches 2" in doctor.check_model(str(m), "float32")[1].detail
    wrong = doctor.check_model(str(m), "bfloat16")[1]
    assert wrong.status == FAIL and "bfloat16" in wrong.detail
    missing = doctor.check_model(str(tmp_path / "nope"), "float32")[0]
    assert missing.status == FAIL and "model folder" in missing.detail


def test_disk_space_thresholds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, 512 << 20))
    assert doctor.check_data_dir(tmp_path)[1].status == FAIL
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, 5 << 30))
    assert doctor.check_data_dir(tmp_path)[1].status == WARN


def test_reachability_from_a_running_nodes_status() -> None:
    def status(reach: str, peers: int = 3) -> dict[str, Any]:
        return {"peer_id": "12D3KooWX", "peers": ["p"] * peers,
                "snapshot": {"role": "worker", "reachability": {"status": reach, "relay": "R", "detail": ""}}}

    assert doctor.check_running(status("public"))[1].status == OK
    private = doctor.check_running(status("private"))[1]
    assert private.status == FAIL and "forward" in private.fix
    assert doctor.check_running(status("relayed"))[1].status == WARN
    assert doctor.check_running(status("unknown", peers=0))[1].status == SKIP


def test_beside_a_running_node_it_reports_the_nodes_real_listen_addresses(tmp_path: Path) -> None:
    """The node listens on a port the kernel chose (``/tcp/0`` in its config): doctor reports the address
    the node holds, read from its control API, not the configured one."""
    from tests.support.swarm import NodeProcess

    d = tmp_path / "n"
    node = NodeProcess(d, "--listen", "/ip4/127.0.0.1/tcp/0")
    try:
        real = node.wait_ready()["listen_addrs"]
        assert real and not any(a.endswith("/tcp/0") for a in real), real
        r = invoke_cli("doctor", "--data-dir", str(d), "--offline", "--json")
        listen = _by_name(json.loads(r.stdout))["listen"]
        assert len(listen) == 1 and listen[0]["status"] == "warn", listen  # loopback: this machine only
        assert all(a in listen[0]["detail"] for a in real) and "/tcp/0" not in listen[0]["detail"], listen
    finally:
        node.close()
