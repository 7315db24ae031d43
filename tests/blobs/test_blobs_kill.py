"""SIGKILL in the middle of a transfer: a provider dies (the download completes from the others), and
a download process dies (a new one resumes without refetching the chunks already on disk).

Killed processes are ``python -m intellect_node.blobs.peer`` children started here, ended by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from intellect_node.blobs.fetch import Progress, StaticProvider
from intellect_node.protocol.blob import HTTP_PREFIX
from tests.blobs.test_blobs_fetch import Node, _copy_blob, _serve

CHUNK = 64 * 1024


class PeerProc:
    """A ``blob_peer`` child process driven over its stdin/stdout JSON lines."""

    def __init__(self, proc: asyncio.subprocess.Process, hello: dict[str, Any]) -> None:
        self.proc = proc
        self.url: str = hello["url"]
        self.peer_id: str = hello["peer_id"]

    @classmethod
    async def start(cls, root: Path) -> "PeerProc":
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "intellect_node.blobs.peer", "--root", str(root),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        hello = json.loads(line)
        assert hello["event"] == "listening", hello
        return cls(proc, hello)

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def event(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert line, "blob_peer exited"
        ev: dict[str, Any] = json.loads(line)
        return ev

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                # Already dead and reaped by asyncio's child watcher, whose returncode update is still on
                # its way to the loop (the progress callback kills again a moment after the first kill).
                pass

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.kill()
                await self.proc.wait()


def test_provider_sigkilled_mid_transfer(tmp_path: Path) -> None:
    data = os.urandom(48 * CHUNK + 5)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = await Node(tmp_path / "origin").start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        # The victim holds the whole blob in its own process.
        victim_root = tmp_path / "victim"
        holder = Node(victim_root)
        _copy_blob(origin.svc.store, holder.svc.store, cid)
        victim = await PeerProc.start(victim_root)
        f = await Node(tmp_path / "fetcher").start()
        f.providers = [StaticProvider(victim.peer_id, victim.url), origin.as_provider()]

        def on_progress(p: Progress) -> None:
            if p.provider == victim.peer_id:
                victim.kill()  # its other worker's request is in flight right now

        try:
            stats = await f.svc.fetch(cid, out=tmp_path / "out.bin", on_progress=on_progress)
            assert await victim.proc.wait() == -signal.SIGKILL
            assert (tmp_path / "out.bin").read_bytes() == data
            assert stats.by_provider.get(victim.peer_id, 0) >= 1
            assert stats.failures.get(victim.peer_id, 0) >= 1
            assert stats.by_provider[origin.peer_id] == len(m.chunks) - stats.by_provider[victim.peer_id]
            assert not stats.bad  # a dead peer is not a malicious one
        finally:
            victim.kill()
            await victim.proc.wait()
            await f.stop()
            await origin.stop()

    asyncio.run(main())


@pytest.mark.parametrize("read_timeout", [1.0, 600.0])
def test_provider_frozen_mid_transfer(tmp_path: Path, read_timeout: float) -> None:
    """SIGSTOP keeps a provider's sockets open and silent (no reset, notes). With a short read deadline
    its requests fail and go elsewhere; with a deadline far past this test's own limit, the end game
    duplicates its stuck chunks at the origin and the download still completes."""
    data = os.urandom(32 * CHUNK)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = await Node(tmp_path / "origin").start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        frozen_root = tmp_path / "frozen"
        _copy_blob(origin.svc.store, Node(frozen_root).svc.store, cid)
        frozen = await PeerProc.start(frozen_root)
        f = await Node(tmp_path / "fetcher", read_timeout=read_timeout).start()
        f.providers = [StaticProvider(frozen.peer_id, frozen.url), origin.as_provider()]

        def on_progress(p: Progress) -> None:
            if p.provider == frozen.peer_id and frozen.proc.returncode is None:
                os.kill(frozen.proc.pid, signal.SIGSTOP)

        try:
            stats = await f.svc.fetch(cid, out=tmp_path / "out.bin", on_progress=on_progress)
            assert (tmp_path / "out.bin").read_bytes() == data
            assert not stats.bad  # frozen is not malicious
            if read_timeout > 60:
                assert stats.endgame_requests >= 1 and not stats.failures
            assert stats.by_provider[origin.peer_id] == len(m.chunks) - stats.by_provider[frozen.peer_id]
        finally:
            frozen.kill()  # SIGKILL ends a stopped process too
            await frozen.proc.wait()
            await f.stop()
            await origin.stop()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_download_process_sigkilled_resumes(tmp_path: Path) -> None:
    n_chunks, first_batch = 16, 5
    data = os.urandom(n_chunks * CHUNK)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)

    async def main() -> None:
        origin = Node(tmp_path / "origin")
        await origin.svc.start()
        cid, m = await origin.svc.put_file(src, chunk_size=CHUNK)
        # The origin serves `first_batch` chunks, then holds every further chunk request until the gate
        # opens: the download is then stuck mid-way, deterministically, when we kill it.
        gate = asyncio.Event()
        requests: list[tuple[int, str]] = []  # (run, chunk cid)
        run = 1
        routes = {r.path: r.handler for r in origin.svc.routes()}
        chunk_route = f"{HTTP_PREFIX}/chunk/{{cid}}"

        async def gated_chunk(request: web.Request) -> web.StreamResponse:
            requests.append((run, request.match_info["cid"]))
            if len(requests) > first_batch:
                await gate.wait()
            return await routes[chunk_route](request)

        runner, url = await _serve([web.get(p, gated_chunk if p == chunk_route else h)
                                    for p, h in routes.items()])
        providers = [{"peer_id": origin.peer_id, "http_url": url}]
        dl_root = tmp_path / "downloader"
        out = tmp_path / "out.bin"
        first = await PeerProc.start(dl_root)
        try:
            await first.send({"op": "fetch", "cid": cid, "providers": providers, "out": str(out)})
            done_first: set[int] = set()
            while len(done_first) < first_batch:
                ev = await first.event()
                assert ev["event"] == "chunk", ev
                done_first.add(ev["index"])
        finally:
            first.kill()
        assert await first.proc.wait() == -signal.SIGKILL
        assert not out.exists()
        run = 2
        gate.set()
        second = await PeerProc.start(dl_root)
        try:
            await second.send({"op": "fetch", "cid": cid, "providers": providers, "out": str(out)})
            while (ev := await second.event())["event"] == "chunk":
                assert ev["index"] not in done_first
            assert ev["event"] == "done", ev
        finally:
            await second.close()
        assert ev["chunks_resumed"] == first_batch
        assert ev["chunks_fetched"] == n_chunks - first_batch
        finished_cids = {m.chunks[i] for i in done_first}
        assert not finished_cids & {c for r, c in requests if r == 2}, "a finished chunk was fetched again"
        assert out.read_bytes() == data
        await runner.cleanup()
        await origin.svc.close()

    asyncio.run(main())
