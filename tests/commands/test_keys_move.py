"""`keys export` / `keys import`: moving a node's identity, with and without a passphrase (the commands in
this process, ``tests.support.cli.invoke_cli``; the running node a real process)."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

from tests.support.cli import invoke_cli
from tests.support.swarm import NodeProcess


def _peer(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_export_import_round_trip_plain_and_encrypted(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    peer = _peer(invoke_cli("keys", "init", "--data-dir", str(old)))
    pem = tmp_path / "key.pem"
    r = invoke_cli("keys", "export", "--data-dir", str(old), "--out", str(pem))
    assert _peer(r) == peer and "not encrypted" in r.stdout
    assert stat.S_IMODE(pem.stat().st_mode) == 0o600
    assert pem.read_text().startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8, what openssl reads
    again = invoke_cli("keys", "export", "--data-dir", str(old), "--out", str(pem))
    assert again.returncode == 2 and "--force" in again.stderr

    r = invoke_cli("keys", "import", str(pem), "--data-dir", str(new))
    assert _peer(r) == peer and peer in r.stdout.splitlines()[0]
    assert stat.S_IMODE((new / "node.key").stat().st_mode) == 0o600
    assert _peer(invoke_cli("keys", "show", "--data-dir", str(new))) == peer

    # an existing key is not replaced without --force; the message names both peer IDs
    other = _peer(invoke_cli("keys", "init", "--data-dir", str(tmp_path / "other")))
    pem2 = tmp_path / "other.pem"
    _peer(invoke_cli("keys", "export", "--data-dir", str(tmp_path / "other"), "--out", str(pem2)))
    refused = invoke_cli("keys", "import", str(pem2), "--data-dir", str(new))
    assert refused.returncode == 2 and peer in refused.stderr and other in refused.stderr
    assert _peer(invoke_cli("keys", "show", "--data-dir", str(new))) == peer
    assert _peer(invoke_cli("keys", "import", str(pem2), "--data-dir", str(new), "--force")) == other

    # encrypted: the passphrase is needed, a wrong one is told apart from a broken file
    secret, wrong = tmp_path / "pass.txt", tmp_path / "wrong.txt"
    secret.write_text("correct horse battery staple\n")
    wrong.write_text("hunter2\n")
    enc = tmp_path / "enc.pem"
    r = invoke_cli("keys", "export", "--data-dir", str(old), "--out", str(enc), "--passphrase-file",
                   str(secret))
    assert _peer(r) == peer and "(encrypted)" in r.stdout
    assert "ENCRYPTED PRIVATE KEY" in enc.read_text()
    dst = tmp_path / "enc-dst"
    need = invoke_cli("keys", "import", str(enc), "--data-dir", str(dst))
    assert need.returncode == 2 and "encrypted" in need.stderr
    bad = invoke_cli("keys", "import", str(enc), "--data-dir", str(dst), "--passphrase-file", str(wrong))
    assert bad.returncode == 2 and "wrong passphrase" in bad.stderr and not (dst / "node.key").exists()
    assert _peer(invoke_cli("keys", "import", str(enc), "--data-dir", str(dst), "--passphrase-file",
                         str(secret))) == peer
    # prompted passphrase (stdin when there is no terminal)
    dst2 = tmp_path / "enc-dst2"
    r = invoke_cli("keys", "import", str(enc), "--data-dir", str(dst2), "--passphrase",
                input="correct horse battery staple\n")
    assert _peer(r) == peer

    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    r = invoke_cli("keys", "import", str(junk), "--data-dir", str(tmp_path / "j"))
    assert r.returncode == 2 and "not a PEM private key" in r.stderr


def test_import_refused_while_the_node_runs(tmp_path: Path) -> None:
    d = tmp_path / "n"
    node = NodeProcess(d)
    try:
        peer = node.wait_ready()["peer_id"]
        pem = tmp_path / "k.pem"
        assert _peer(invoke_cli("keys", "export", "--data-dir", str(d), "--out", str(pem))) == peer
        r = invoke_cli("keys", "import", str(pem), "--data-dir", str(d), "--force")
        assert r.returncode == 2 and "stop it" in r.stderr
    finally:
        node.close()
