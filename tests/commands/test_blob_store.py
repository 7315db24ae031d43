"""`blob ls / rm / gc` and `blob get --no-keep`: on a data dir without a node (under its lock) and through
running node processes (their control API), on real files. The commands run in this process
(``tests.support.cli.invoke_cli``); the nodes they talk to are real processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from intellect_node.blobs.store import CHUNK_HASH
from intellect_node.protocol.ids import cid_of
from tests.support.cli import invoke_cli
from tests.support.swarm import NodeProcess

KIB = 1024


def _put(d: Path, src: Path) -> str:
    r = invoke_cli("blob", "put", str(src), "--data-dir", str(d), "--chunk-mib", str(4 / 1024))  # 4 KiB
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def _ls(d: Path) -> dict[str, dict[str, Any]]:
    r = invoke_cli("blob", "ls", "--data-dir", str(d), "--json")
    assert r.returncode == 0, r.stderr
    return {b["cid"]: b for b in map(json.loads, r.stdout.splitlines())}


def _disk(d: Path) -> int:
    return sum(p.stat().st_size for p in (d / "blobs" / "chunks").iterdir())


def test_ls_rm_gc_without_a_node(tmp_path: Path) -> None:
    d = tmp_path / "node"
    assert invoke_cli("keys", "init", "--data-dir", str(d)).returncode == 0
    shared = os.urandom(8 * KIB)
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    a.write_bytes(shared + os.urandom(4 * KIB))  # a and b share their first two chunks
    b.write_bytes(shared + os.urandom(4 * KIB))
    c.write_bytes(os.urandom(6 * KIB))
    cid_a, cid_b, cid_c = _put(d, a), _put(d, b), _put(d, c)

    blobs = _ls(d)
    assert set(blobs) == {cid_a, cid_b, cid_c}
    assert blobs[cid_a]["name"] == "a.bin" and blobs[cid_a]["size"] == 12 * KIB and blobs[cid_a]["complete"]
    human = invoke_cli("blob", "ls", "--data-dir", str(d))
    assert "complete" in human.stdout and "3 blob(s)" in human.stderr

    # a partial blob: one of c's chunks gone from disk
    (d / "blobs" / "chunks" / _chunk_cid(c.read_bytes()[:4 * KIB])).unlink()
    part = _ls(d)[cid_c]
    assert not part["complete"] and part["held"] == 2 * KIB
    assert "partial 33%" in invoke_cli("blob", "ls", "--data-dir", str(d)).stdout

    # rm a: its own chunk goes, the two it shares with b stay; b is still whole
    before = _disk(d)
    r = invoke_cli("blob", "rm", cid_a, "--data-dir", str(d))
    assert r.returncode == 0, r.stderr
    assert before - _disk(d) == 4 * KIB
    assert set(_ls(d)) == {cid_b, cid_c} and _ls(d)[cid_b]["complete"]
    missing = invoke_cli("blob", "rm", cid_a, "--data-dir", str(d))
    assert missing.returncode == 2 and "blob ls" in missing.stderr
    assert invoke_cli("blob", "rm", "not-a-cid", "--data-dir", str(d)).returncode == 2

    # b is the trainer's current full checkpoint: pinned, shown, refused by rm, kept by gc
    (d / "trainer" / "policy").mkdir(parents=True)
    (d / "trainer" / "policy" / "publisher.json").write_text(json.dumps(
        {"version": 3, "hash": "x", "full": [3, cid_b, 12 * KIB], "links": []}))
    assert _ls(d)[cid_b]["pinned"] == "trainer: policy v3 (full)"
    pinned = invoke_cli("blob", "rm", cid_b, "--data-dir", str(d))
    assert pinned.returncode == 2 and "pinned" in pinned.stderr and "--force" in pinned.stderr

    # an orphan chunk (listed by no manifest), e.g. left by an interrupted add
    orphan = os.urandom(KIB)
    (d / "blobs" / "chunks" / _chunk_cid(orphan)).write_bytes(orphan)
    # young blobs stay under the default minimum age
    young = invoke_cli("blob", "gc", "--data-dir", str(d))
    assert young.returncode == 0 and "removed 0 blob(s)" in young.stderr
    dry = invoke_cli("blob", "gc", "--data-dir", str(d), "--min-age", "0", "--dry-run")
    assert dry.stdout.split()[:3] == ["would", "remove", cid_c] and set(_ls(d)) == {cid_b, cid_c}
    r = invoke_cli("blob", "gc", "--data-dir", str(d), "--min-age", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["removed", cid_c] and "1 orphan chunk(s)" in r.stderr
    assert set(_ls(d)) == {cid_b}
    assert _disk(d) == 12 * KIB  # exactly b's three chunks are left
    forced = invoke_cli("blob", "rm", cid_b, "--data-dir", str(d), "--force")
    assert forced.returncode == 0 and _ls(d) == {} and _disk(d) == 0


def _chunk_cid(data: bytes) -> str:
    return cid_of(data, CHUNK_HASH)  # chunk files are named by their CID


def test_get_no_keep_and_gc_through_running_nodes(tmp_path: Path) -> None:
    a = NodeProcess(tmp_path / "a")
    b: NodeProcess | None = None
    try:
        addr = a.wait_ready()["listen_addrs"][0]
        b = NodeProcess(tmp_path / "b", "--bootstrap", addr)
        b.wait_ready()
        src = tmp_path / "w.bin"
        src.write_bytes(os.urandom(40 * KIB))
        cid = _put(tmp_path / "a", src)
        db = tmp_path / "b"

        # --no-keep: the file is written, the store keeps nothing of it
        out = tmp_path / "out1.bin"
        r = invoke_cli("blob", "get", cid, "--out", str(out), "--data-dir", str(db), "--no-keep", "-q")
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == src.read_bytes() and "dropped" in r.stderr
        assert _ls(db) == {} and _disk(db) == 0

        # kept by default: listed through B's control API; gc through it, respecting the minimum age
        out2 = tmp_path / "out2.bin"
        r = invoke_cli("blob", "get", cid, "--out", str(out2), "--data-dir", str(db), "-q")
        assert r.returncode == 0, r.stderr
        held = _ls(db)[cid]
        assert held["complete"] and held["held"] == 40 * KIB and not held["fetching"]
        assert "removed 0 blob(s)" in invoke_cli("blob", "gc", "--data-dir", str(db)).stderr
        r = invoke_cli("blob", "gc", "--data-dir", str(db), "--min-age", "0")
        assert r.returncode == 0 and r.stdout.split() == ["removed", cid], r.stderr
        assert _ls(db) == {} and _disk(db) == 0
        # B still fetches it again afterwards (its announcement state was reset), and A still serves it
        out3 = tmp_path / "out3.bin"
        r = invoke_cli("blob", "get", cid, "--out", str(out3), "--data-dir", str(db), "-q")
        assert r.returncode == 0 and out3.read_bytes() == src.read_bytes(), r.stderr
        assert b.status()["peer_id"] and a.status()["blobs"]["blobs"][0]["cid"] == cid
    finally:
        a.close()
        if b is not None:
            b.close()
