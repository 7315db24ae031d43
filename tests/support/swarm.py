"""Swarm test helpers: N real libp2p nodes on 127.0.0.1 wired from an adjacency map.

In-process (fast; each node has its own trio thread, all share one asyncio loop)::

    async with swarm_nodes(6, line(6)) as nodes:          # list[Swarm]
        ...
    async with runtime_nodes(tmp_path, 6, line(6), services=[factory]) as rts:   # list[NodeRuntime]
        ...

``run(coro)`` runs a coroutine from a plain (sync) pytest test with an overall deadline.
As processes through the real CLI: :class:`NodeProcess` (``intellect-node join``, started and killed by
PID through the product's supervisor, ``intellect_node.node.processes``), forked warm from this test
process's preloaded server (``node/warmstart.py``: the imports paid once per xdist worker, not once per
node); ``INTELLECT_NODE_TESTS_COLD=1`` starts every one with exec instead. Runtimes are put together by
``intellect_node.node.assembly``, like every node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from intellect_node.errors import IntellectNodeError
from intellect_node.node import processes
from intellect_node.node.warmstart import WarmStarter
from tests.support.common import CLI, REPO
from tests.support.wait import wait_until

T = TypeVar("T")
Edges = dict[int, list[int]]

WARM: WarmStarter | None = None if os.environ.get("INTELLECT_NODE_TESTS_COLD") else WarmStarter()
"""The one warm server of this test process (started on the first node), or None: every node cold."""


def run(coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run ``coro`` to completion from sync code; fail (not hang) after ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def line(n: int) -> Edges:
    """0 - 1 - 2 - ... - n-1"""
    return {i: [i + 1] for i in range(n - 1)}


def star(n: int) -> Edges:
    """0 in the middle, 1..n-1 around it."""
    return {0: list(range(1, n))}


def ring(n: int) -> Edges:
    return {i: [(i + 1) % n] for i in range(n)}


def _pairs(edges: Edges) -> list[tuple[int, int]]:
    out = set()
    for a, bs in edges.items():
        for b in bs:
            if a != b:
                out.add((min(a, b), max(a, b)))
    return sorted(out)


async def wire(nodes: list[Any], edges: Edges, timeout: float = 20.0) -> None:
    """Connect the pairs in ``edges`` (each node a Swarm) and wait until both ends see the link."""
    pairs = _pairs(edges)
    await asyncio.gather(*(nodes[a].connect(nodes[b].listen_addrs()[0]) for a, b in pairs))
    await wait_until(lambda: all(nodes[b].peer_id in nodes[a].connected_peers()
                                 and nodes[a].peer_id in nodes[b].connected_peers() for a, b in pairs),
                     timeout, what="all links up")


@contextlib.asynccontextmanager
async def swarm_nodes(n: int, edges: Edges | None = None, *, run_id: str = "test",
                      http_urls: Iterable[str] | None = None,
                      data_dirs: Iterable[Path] | None = None) -> AsyncIterator[list[Any]]:
    """``n`` started :class:`Swarm` s (no HTTP, no heartbeats) wired by ``edges``; closed on exit."""
    from intellect_node.p2p.swarm import Swarm
    from intellect_node.protocol.signing import SigningKey

    urls = list(http_urls) if http_urls is not None else [f"http://127.0.0.1:{10000 + i}" for i in range(n)]
    dirs = list(data_dirs) if data_dirs is not None else [None] * n
    nodes: list[Any] = []
    try:
        nodes.extend(await asyncio.gather(*(
            Swarm.start(SigningKey.generate(), run_id=run_id, listen=["/ip4/127.0.0.1/tcp/0"],
                        http_url=urls[i], data_dir=dirs[i]) for i in range(n))))
        if edges:
            await wire(nodes, edges)
        yield nodes
    finally:
        await asyncio.gather(*(s.close() for s in nodes), return_exceptions=True)


@contextlib.asynccontextmanager
async def runtime_nodes(root: Path, n: int, edges: Edges | None = None, *, run_id: str = "test",
                        services: Iterable[Callable[[Any], Any]] = (), heartbeat_interval: float = 2.0,
                        peer_timeout: float = 8.0, roles: list[list[str]] | None = None
                        ) -> AsyncIterator[list[Any]]:
    """``n`` full :class:`NodeRuntime` s (HTTP, control API, heartbeats, ``services``) in
    ``root/node<i>``, wired by ``edges``; stopped on exit. ``rts[i].swarm`` is node i's Swarm.

    All nodes share one process and one GIL: py-libp2p costs ~20 ms of CPU per gossip message per node,
    so frequent heartbeats starve the DHT on a busy machine (seen: 30 s provides at 0.5 s heartbeats on
    six nodes). Keep ``heartbeat_interval`` at a second or more unless the test is about heartbeats."""
    from intellect_node.config import build_config
    from intellect_node.node.assembly import build_node

    cfg = build_config(network={"heartbeat_interval": heartbeat_interval, "peer_timeout": peer_timeout,
                                "http_host": "127.0.0.1"}, run={"run_id": run_id})
    # Only the services the test gives: ``roles`` here are what the nodes say they are (heartbeats).
    rts = [build_node(cfg, root / f"node{i}", labels=(roles[i] if roles else []), services=list(services),
                      common=False) for i in range(n)]
    started: list[Any] = []
    try:
        for rt in rts:  # sequential: each start binds ports and may spawn service tasks
            await rt.start()
            started.append(rt)
        if edges:
            await wire([rt.swarm for rt in rts], edges)
        yield rts
    finally:
        await asyncio.gather(*(rt.stop() for rt in started), return_exceptions=True)


class NodeProcess(processes.NodeProcess):
    """``intellect-node join --headless --data-dir DATA_DIR *args`` as a child process (the way a user runs
    it), output in ``<data_dir>.log`` beside the data dir; :meth:`close` kills it by PID. ``netns``: run it
    in that network namespace (``testing.netns.Topology``)."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None,
                 argv: list[str] | None = None, netns: str | None = None) -> None:
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        full_env = {**os.environ, **(env or {})}
        command = [CLI, "join", "--data-dir", str(data_dir), "--headless", *args] if argv is None else argv
        super().__init__(command, data_dir, output=self.log_path, env=full_env, cwd=REPO, netns=netns,
                         starter=WARM)

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for control.json and a status answer; return the status (a test failure otherwise)."""
        try:
            return super().wait_ready(timeout)
        except IntellectNodeError as exc:  # the child's exit code and last output, or "did not start"
            raise AssertionError(str(exc)) from exc

    def cli_status(self) -> dict[str, Any]:
        out = subprocess.run([CLI, "status", "--data-dir", str(self.data_dir), "--json"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def wait(self, timeout: float = 30.0) -> int:
        return super().wait(timeout)

    def log(self) -> str:
        return self.output_text(4000)

    def close(self) -> None:
        self.kill()
