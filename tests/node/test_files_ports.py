"""Files and ports: the data dir is private (0700, tightened with a log line), the ledger with its
-wal/-shm and the logs are 0600, ``join`` refuses a listen port another process holds (py-libp2p's
listener would share it through SO_REUSEPORT), port 0 and a restart on the node's own port keep working,
and ``proofs calibrate`` never overwrites the thresholds shipped in the package."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from intellect_node.commands import checks
from intellect_node.config.ledger import Ledger
from intellect_node.errors import ConfigError
from intellect_node.fsutil import ensure_private_file
from intellect_node.p2p.identity import ensure_data_dir, init_key
from intellect_node.p2p.ports import check_listen_ports, fixed_ports
from tests.support.common import CLI, run_cli
from tests.support.ports import free_port
from tests.support.wait import wait_for


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)




# -- modes, in process ----------------------------------------------------------------------------

def test_data_dir_is_created_private_and_a_loose_one_is_tightened(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    old = os.umask(0)  # even with no umask the dir is not created readable by others
    try:
        fresh = ensure_data_dir(tmp_path / "a" / "node")
    finally:
        os.umask(old)
    assert mode(fresh) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with caplog.at_level(logging.INFO, logger="intellect_node.p2p.identity"):
        ensure_data_dir(loose)
    assert mode(loose) == 0o700
    assert any("tightened" in r.getMessage() and "755" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="intellect_node.p2p.identity"):
        ensure_data_dir(loose)
    assert not caplog.records  # nothing to say the second time

    init_key(tmp_path / "keyed")
    assert mode(tmp_path / "keyed") == 0o700 and mode(tmp_path / "keyed" / "node.key") == 0o600


def test_private_files_ledger_and_log_file(tmp_path: Path) -> None:
    from intellect_node.logsetup import setup_logging

    d = ensure_data_dir(tmp_path / "node")
    with Ledger.in_data_dir(d) as led:
        led.record_submission("b1", run_id="r", policy_version=0, n_rollouts=1, n_tokens=5)
        files = sorted(p.name for p in d.iterdir())
        assert files == ["ledger.sqlite", "ledger.sqlite-shm", "ledger.sqlite-wal"]
        assert all(mode(d / f) == 0o600 for f in files), {f: oct(mode(d / f)) for f in files}

    # An older ledger left readable by others: tightened when the node opens it, companions included.
    for f in ("ledger.sqlite", "ledger.sqlite-wal"):
        (d / f).touch()
        (d / f).chmod(0o644)
    Ledger.in_data_dir(d).close()
    assert mode(d / "ledger.sqlite") == 0o600
    assert not (d / "ledger.sqlite-wal").exists() or mode(d / "ledger.sqlite-wal") == 0o600

    log_file = tmp_path / "logs" / "node.log"
    handler = setup_logging(level="INFO", file=log_file)
    try:
        logging.getLogger("intellect_node.test").warning("hello")
        handler.flush()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert mode(log_file) == 0o600 and "hello" in log_file.read_text()
    assert mode(log_file.parent) == 0o700  # a log dir it creates (often the data dir) is private too
    ensure_private_file(Path("/dev/null"))  # not a regular file: left alone
    assert stat.S_IMODE(os.stat("/dev/null").st_mode) == 0o666


# -- ports, in process ----------------------------------------------------------------------------

def test_libp2p_shares_a_taken_port_and_the_check_refuses_it() -> None:
    """The defect and its guard: a second py-libp2p host listens on a port the first one holds
    (SO_REUSEPORT in libp2p/transport/tcp/tcp.py); check_listen_ports refuses that port."""
    from intellect_node.p2p.swarm import Swarm
    from intellect_node.protocol.signing import SigningKey

    async def main() -> None:
        port = free_port()
        addr = f"/ip4/127.0.0.1/tcp/{port}"
        a = await Swarm.start(SigningKey.generate(), run_id="t", listen=[addr])
        try:
            check_listen_ports(["/ip4/127.0.0.1/tcp/0"])  # port 0 is never refused
            with pytest.raises(ConfigError) as err:
                check_listen_ports([addr])
            assert err.value.field == "listen"
            text = str(err.value)
            assert f"--listen {addr}" in text and "already in use" in text and "port 0" in text
            # Without the check, libp2p takes the same port a second time (this is what join prevented).
            b = await Swarm.start(SigningKey.generate(), run_id="t", listen=[addr])
            try:
                assert b.listen_addrs()[0].startswith(addr + "/p2p/")
            finally:
                await b.close()
        finally:
            await a.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_port_check_udp_time_wait_and_parsing() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        # as py-libp2p's QUIC listener sets them (libp2p/transport/quic/listener.py)
        u.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        u.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        u.bind(("127.0.0.1", 0))
        uport = u.getsockname()[1]
        with pytest.raises(ConfigError, match="udp port"):
            check_listen_ports([f"/ip4/127.0.0.1/udp/{uport}/quic-v1"])
    # A port whose listener is gone but whose connections sit in TIME_WAIT (a node just killed) is free.
    srv = socket.socket()
    # as libp2p's listener: accepted sockets inherit it
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    srv.close()
    cli.close()
    check_listen_ports([f"/ip4/127.0.0.1/tcp/{port}"])
    assert fixed_ports(["/ip4/127.0.0.1/tcp/0", "/dns4/example.org/tcp/4001", "/ip4/1.2.3.4/tcp/x",
                        "/ip6/::1/tcp/4001", "/p2p-circuit"]) == [("::1", "tcp", 4001, "/ip6/::1/tcp/4001")]


# -- join, as processes ---------------------------------------------------------------------------

def _join(data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([CLI, "join", "--data-dir", str(data_dir), "--headless", "--listen",
                             f"/ip4/127.0.0.1/tcp/{port}", "--http-host", "127.0.0.1",
                             "--log-file", str(log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "INTELLECT_NODE_METRICS__ENABLED": "false"})


def _ready(proc: subprocess.Popen[bytes], data_dir: Path, log: Path) -> bool:
    assert proc.poll() is None, f"node exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
    return (data_dir / "control.json").exists()


@pytest.mark.timeout(300)
def test_join_private_files_refused_port_and_restart_on_own_port(tmp_path: Path) -> None:
    d = tmp_path / "a"
    d.mkdir()
    d.chmod(0o755)  # as an older version (or the umask) left it
    log = d / "node.log"
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a = _join(d, port, log)
        procs.append(a)
        wait_for(lambda: _ready(a, d, log), timeout=180, what="node a up")
        assert mode(d) == 0o700 and "tightened" in log.read_text()
        for name in ("node.key", "control.json", "node.log", "ledger.sqlite", "ledger.sqlite-wal",
                     "ledger.sqlite-shm"):
            assert mode(d / name) == 0o600, (name, oct(mode(d / name)))

        # A second node on the same port is refused before it listens: exit 2, the flag and the fix.
        r = run_cli("join", "--data-dir", str(tmp_path / "b"), "--headless", "--listen",
                    f"/ip4/127.0.0.1/tcp/{port}", env={"INTELLECT_NODE_METRICS__ENABLED": "false"},
                    timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"--listen /ip4/127.0.0.1/tcp/{port}" in r.stderr and "already in use" in r.stderr, r.stderr
        assert not (tmp_path / "b" / "control.json").exists()

        # Killed with a connection open (its end lingers in TIME_WAIT), then restarted on its own port.
        peer = socket.create_connection(("127.0.0.1", port))
        a.send_signal(signal.SIGKILL)
        a.wait(30)
        peer.close()
        (d / "control.json").unlink(missing_ok=True)  # a killed node cannot remove it
        a2 = _join(d, port, log)
        procs.append(a2)
        wait_for(lambda: _ready(a2, d, log), timeout=180, what="node a restarted on its port")
        a2.send_signal(signal.SIGTERM)
        assert a2.wait(60) == 0
        assert mode(d / "ledger.sqlite") == 0o600
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


# -- calibration never writes into the package ----------------------------------------------------

def test_calibrate_refuses_the_shipped_thresholds_without_out(tmp_path: Path) -> None:
    from intellect_node.commands.proofs import thresholds_target
    from intellect_node.models.loader import embedded_model_dir

    shipped = embedded_model_dir() / "proof_thresholds.json"
    before = hashlib.sha256(shipped.read_bytes()).hexdigest()
    r = run_cli("proofs", "calibrate", "--n", "1", "--batch-sizes", "1", timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--out" in r.stderr and "model export" in r.stderr, r.stderr
    r = run_cli("proofs", "calibrate", "--model", str(embedded_model_dir()), timeout=180)
    assert r.returncode == 2 and "--out" in r.stderr
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == before
    out = tmp_path / "th.json"
    assert thresholds_target(None, out) == out


def test_doctor_reports_loose_modes(tmp_path: Path) -> None:
    from intellect_node.commands import doctor

    d = tmp_path / "node"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    (d / "node.log").write_text("x")
    (d / "node.log").chmod(0o644)
    check = doctor.check_private(d)
    assert check.status == checks.WARN and "mode 755" in check.detail and "node.log" in check.detail
    assert "chmod 700" in check.fix
    ensure_data_dir(d)
    ensure_private_file(d / "node.log")
    assert doctor.check_private(d).status == checks.OK
    assert doctor.check_data_dir(d)[-1].name == "file modes"
