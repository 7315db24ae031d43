"""Blobs over a real swarm: DHT provider records across a line of six nodes, and the CLI's
``blob put`` / ``blob get`` through running nodes' control API."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from intellect_node.blobs.service import BlobService
from tests.support.common import CLI
from tests.support.swarm import line, run, runtime_nodes

CHUNK = 64 * 1024
SLOW_HEARTBEATS: dict[str, Any] = {"heartbeat_interval": 5.0, "peer_timeout": 20.0}
"""These tests need no fast liveness; 0.5 s heartbeats on six in-process nodes slowed DHT provide
records from ~3 s to over 30 s on the loaded 2-core test machine."""


def _blob_factory(rt: Any) -> BlobService:
    return BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board)


def _svc(rt: Any) -> BlobService:
    return next(s for s in rt.services if isinstance(s, BlobService))


def test_line_of_six_fetch_three_hops_away(tmp_path: Path) -> None:
    """0-1-2-3-4-5: node 2 publishes; node 5, which knows only node 4, finds it through the DHT and
    fetches the blob byte-identical; then node 5 is found as a provider too (it serves what it got)."""
    data = os.urandom(10 * CHUNK + 99)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)

    async def main() -> None:
        async with runtime_nodes(tmp_path, 6, line(6), services=[_blob_factory], **SLOW_HEARTBEATS) as rts:
            assert rts[5].swarm.connected_peers() == [rts[4].swarm.peer_id]
            holder, fetcher = _svc(rts[2]), _svc(rts[5])
            cid, _ = await holder.put_file(src, chunk_size=CHUNK)
            await holder.settle()  # the provider record is out
            found = await rts[5].swarm.find_providers(cid)
            assert [p.peer_id for p in found] == [rts[2].swarm.peer_id]
            assert found[0].http_url == rts[2].http_url
            stats = await fetcher.fetch(cid, out=tmp_path / "out.bin")
            assert (tmp_path / "out.bin").read_bytes() == data
            assert stats.by_provider == {rts[2].swarm.peer_id: 11}
            await fetcher.settle()
            again = {p.peer_id for p in await rts[0].swarm.find_providers(cid)}
            assert again == {rts[2].swarm.peer_id, rts[5].swarm.peer_id}

    run(main(), timeout=120)


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(CLI, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_cli_put_and_get_through_running_nodes(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    src = tmp_path / "weights.bin"
    src.write_bytes(data)
    out = tmp_path / "fetched.bin"

    async def main() -> None:
        async with runtime_nodes(tmp_path, 2, line(2), services=[_blob_factory], **SLOW_HEARTBEATS) as rts:
            d0, d1 = str(rts[0].data_dir), str(rts[1].data_dir)
            rc, cid, err = await _cli("blob", "put", str(src), "--data-dir", d0, "--chunk-mib", "1")
            assert rc == 0, err
            cid = cid.strip()
            await _svc(rts[0]).settle()
            rc, stdout, err = await _cli("blob", "get", cid, "-o", str(out), "--data-dir", d1)
            assert rc == 0, err
            assert out.read_bytes() == data
            assert "4 chunks fetched" in stdout
            # Operator mistakes exit 2 naming what to fix; a node that cannot find the blob exits 1.
            rc, _, err = await _cli("blob", "get", "not-a-cid", "-o", str(out), "--data-dir", d1)
            assert rc == 2 and "CID" in err
            rc, _, err = await _cli("blob", "put", str(tmp_path / "missing.bin"), "--data-dir", d0)
            assert rc == 2 and "FILE" in err
        # With no node running, put stores the blob in the data dir for the next start.
        rc, cid2, err = await _cli("blob", "put", str(src), "--data-dir", d0, "--chunk-mib", "1")
        assert rc == 0 and "stored locally" in err and cid2.strip() == cid

    run(main(), timeout=150)
