"""NodeRuntime in-process: the service seam, the token-protected control API, heartbeats with roles."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from intellect_node.errors import ConfigError
from intellect_node.node import control
from tests.support.ports import free_port
from tests.support.swarm import line, run, runtime_nodes
from tests.support.wait import wait_until


class EchoService:
    """What another part plugs in: bulk routes, control routes, status, start/close."""

    name = "echo"

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.events: list[str] = []

    def routes(self) -> list[web.RouteDef]:
        async def hello(_r: web.Request) -> web.Response:
            return web.json_response({"peer": self.runtime.swarm.peer_id})
        return [web.get("/echo/v1/hello", hello)]

    def control_routes(self) -> list[web.RouteDef]:
        async def ping(_r: web.Request) -> web.Response:
            return web.json_response({"pong": True})
        return [web.post("/v1/echo/ping", ping)]

    def status(self) -> dict[str, Any]:
        return {"events": list(self.events)}

    async def start(self) -> None:
        self.events.append("start")

    async def close(self) -> None:
        self.events.append("close")


def _get(url: str, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_runtime_services_control_api_and_heartbeat_roles(tmp_path: Path) -> None:
    made: list[EchoService] = []

    def factory(rt: Any) -> EchoService:
        made.append(EchoService(rt))
        return made[-1]

    async def main() -> None:
        async with runtime_nodes(tmp_path, 3, line(3), services=[factory],
                                 roles=[["trainer"], ["worker"], ["validator"]]) as rts:
            a, b, c = rts
            assert [s.events for s in made] == [["start"]] * 3
            code, body = await _aget(f"{a.http_url}/echo/v1/hello")
            assert code == 200 and body == {"peer": a.swarm.peer_id}

            url, token = control.read_control_file(a.data_dir)
            assert (await _aget(f"{url}/v1/status"))[0] == 401
            assert (await _aget(f"{url}/v1/status", "wrong"))[0] == 401
            code, st = await _aget(f"{url}/v1/status", token)
            assert code == 200 and st["peer_id"] == a.swarm.peer_id and st["echo"] == {"events": ["start"]}

            # Heartbeats cross two hops and carry roles and URLs; the status board counts them.
            await wait_until(
                lambda: set(a.swarm.peerbook.alive_peers()) == {b.swarm.peer_id, c.swarm.peer_id},
                10, what="a hears b and c")
            assert a.swarm.peerbook.http_url(c.swarm.peer_id) == c.http_url
            await wait_until(lambda: a.board.snapshot().peers.validators == (c.swarm.peer_id,), 5,
                             what="board lists c as validator")
            assert a.board.snapshot().peers.workers == (b.swarm.peer_id,)
            # The provider URL of a peer heard by heartbeat needs no node-info round trip.
            await c.swarm.provide("bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy")
            provs = await a.swarm.find_providers(
                "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy")
            assert [(p.peer_id, p.http_url) for p in provs] == [(c.swarm.peer_id, c.http_url)]

            # POST /v1/stop asks the node to stop (the process's main then shuts down).
            req = urllib.request.Request(f"{url}/v1/stop", method="POST",
                                         headers={"Authorization": f"Bearer {token}"})
            await _ato(lambda: urllib.request.urlopen(req, timeout=5).read())
            await wait_until(lambda: a._stop_event.is_set(), 5, what="stop requested")
        assert [s.events for s in made] == [["start", "close"]] * 3
        with pytest.raises(ConfigError):
            control.read_control_file(tmp_path / "node0")

    run(main(), 90)


T = TypeVar("T")


async def _ato(fn: Callable[[], T]) -> T:
    import asyncio

    return await asyncio.to_thread(fn)


async def _aget(url: str, token: str | None = None) -> tuple[int, Any]:
    return await _ato(lambda: _get(url, token))


def test_a_node_started_before_its_bootstrap_peer_reaches_it_once_that_peer_listens(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nodes launched together (a compose file, the learning benchmark): the joiner's first dial meets a
    closed port, and its bootstrap retry (``runtime.BOOTSTRAP_RETRY_S``) reaches the peer once it is up,
    then ends as a task that is done, not as one that died (no error in the operator's log). The failed
    dial also put the peer in py-libp2p's 60 s dial negative cache, which must not refuse the retries
    (``host.P2PHost.connect`` clears it)."""
    from intellect_node.config import build_config
    from intellect_node.node.assembly import build_node
    from intellect_node.p2p.identity import init_key

    port = free_port()
    boot_id = init_key(tmp_path / "boot").peer_id
    net = {"heartbeat_interval": 2.0, "peer_timeout": 8.0, "http_host": "127.0.0.1"}
    boot_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"
    joiner = build_node(build_config(network={**net, "bootstrap": [boot_addr]}, run={"run_id": "test"}),
                        tmp_path / "joiner", common=False)
    boot = build_node(build_config(network={**net, "listen": [f"/ip4/127.0.0.1/tcp/{port}"]},
                                   run={"run_id": "test"}), tmp_path / "boot", common=False)

    async def main() -> None:
        await joiner.start()
        try:
            assert joiner.swarm.connected_peers() == []  # nothing listened there: its dial failed
            await boot.start()
            try:
                assert boot.swarm.peer_id == boot_id
                await wait_until(lambda: boot_id in joiner.swarm.connected_peers(), 60,
                                 what="the joiner's retry reaches the bootstrap peer")
                retry = joiner._bootstrap_task
                assert retry is not None
                await asyncio.wait_for(retry, 60)  # it ends once a peer is connected
                errors = [r.getMessage() for r in caplog.records
                          if r.levelno >= logging.ERROR and r.name.startswith("intellect_node")]
                assert errors == [], errors
            finally:
                await boot.stop()
        finally:
            await joiner.stop()

    run(main(), 120)
