"""Liveness in-process (real libp2p hosts on 127.0.0.1, real sockets): libp2p that dies, stops or wedges
comes back re-subscribed, re-dialed and re-provided while the board says degraded; essential tasks are
restarted or end the node; the systemd watchdog goes quiet while the node is unhealthy.
(tests/node/test_liveness_process.py does the same through a real `intellect-node join` process.)"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from intellect_node.errors import TransportError
from intellect_node.node.sdnotify import Notifier
from intellect_node.p2p.bridge import TrioThread
from intellect_node.p2p.liveness import EXIT_UNHEALTHY
from tests.support.swarm import line, run, runtime_nodes
from tests.support.wait import wait_until

TOPIC = "/intellect/test/liveness/1"
CID = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"


class Reattach:
    """A service with trio state of its own: it re-attaches through ``swarm.on_restart``."""

    name = "reattach"

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.generations: list[int] = []

    async def start(self) -> None:
        self.rt.swarm.on_restart.append(self._again)

    async def _again(self) -> None:
        self.generations.append(self.rt.swarm.bridge.generation)

    async def close(self) -> None:
        pass


async def _inject(sw: Any, fault: str) -> None:
    if fault == "raise":  # what the pubsub DecodeError of issue #12 did: the trio thread ends
        async def boom() -> None:
            raise RuntimeError("injected by the test")

        sw.bridge.start_soon(boom)
    elif fault == "cancel":  # libp2p's Swarm service ends quietly; the thread and its listener live on
        async def cancel() -> None:
            sw.p2p.host.get_network().get_manager().cancel()

        await sw.bridge.call(cancel)
    else:  # a blocking call on the trio thread: nothing there answers for 4 s
        sw.watch.answer_timeout = 1.0
        sw.bridge.run_sync_soon(time.sleep, 4.0)


async def _delivered(src: Any, got: list[bytes], tag: bytes) -> None:
    """Publish numbered messages from ``src`` until one arrives (a mesh may still be forming)."""
    for i in range(20):
        await src.publish(TOPIC, tag + b"-%d" % i)
        try:
            await wait_until(lambda: any(m.startswith(tag) for m in got), 1.0, what=f"{tag!r} delivered")
            return
        except AssertionError:
            continue
    raise AssertionError(f"{tag!r} never delivered")


async def _local_providers(p2p: Any, cid: str) -> list[str]:
    from intellect_node.p2p import compat as compat

    return [p.peer_id.to_base58() for p in p2p.dht.provider_store.get_providers(compat.encode_dht_key(cid))]


@pytest.mark.parametrize("fault", ["raise", "cancel", "wedge"])
def test_libp2p_failures_are_restarted_resubscribed_and_reported(tmp_path: Path, fault: str) -> None:
    made: list[Reattach] = []

    def reattach(rt: Any) -> Reattach:
        made.append(Reattach(rt))
        return made[-1]

    async def main() -> None:
        async with runtime_nodes(tmp_path, 2, line(2), heartbeat_interval=1.0,
                                 services=[reattach]) as (a, b):
            got_a: list[bytes] = []
            got_b: list[bytes] = []
            a.swarm.subscribe(TOPIC, lambda d, o: d, lambda m, o: got_a.append(m))
            b.swarm.subscribe(TOPIC, lambda d, o: d, lambda m, o: got_b.append(m))

            def both() -> bool:
                return (a.swarm.peer_id in b.swarm.topic_peers(TOPIC)
                        and b.swarm.peer_id in a.swarm.topic_peers(TOPIC))

            await wait_until(both, 20, what="subscriptions known")
            await _delivered(b.swarm, got_a, b"before")
            await a.swarm.provide(CID)
            port = a.swarm.listen_addrs()[0].split("/tcp/")[1].split("/")[0]
            seen: list[tuple[str, tuple[str, ...]]] = []
            a.board.subscribe(lambda s: seen.append((s.state, s.health.reasons)))

            await _inject(a.swarm, fault)
            await wait_until(lambda: a.swarm.watch.restarts == 1, 30, what="libp2p restarted")
            # degraded meanwhile, with the reason; running after, with the restart counted
            assert any(state == "degraded" and any(r.startswith("libp2p restarting:") for r in reasons)
                       for state, reasons in seen), seen
            await wait_until(lambda: a.board.snapshot().state == "running", 10, what="running again")
            assert a.board.snapshot().health.restarts == {"libp2p": 1}
            assert a.swarm.listen_addrs()[0].split("/tcp/")[1].split("/")[0] == port  # same address
            # re-dialed and re-subscribed: gossip flows both ways again, each message once
            await wait_until(both, 20, what="subscriptions again")
            await _delivered(b.swarm, got_a, b"after")
            await _delivered(a.swarm, got_b, b"back")
            assert len(got_a) == len(set(got_a)), got_a
            # re-provided on the new host; the service re-attached to the new run
            for _ in range(100):
                if a.swarm.peer_id in await a.swarm.bridge.call(_local_providers, a.swarm.p2p, CID):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("CID not provided again")
            assert made[0].generations == [2] and made[1].generations == []
            assert b.swarm.watch.restarts == 0 and b.board.snapshot().health.reasons == ()

    run(main(), 120)


def test_essential_tasks_are_restarted_and_one_that_keeps_failing_ends_the_node(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with runtime_nodes(tmp_path, 1) as (rt,):
            sup = rt.supervisor
            sup.backoff, sup.stable_after, sup.max_failures = (0.05,), 0.5, 2
            seen: list[tuple[str, tuple[str, ...]]] = []
            rt.board.subscribe(lambda s: seen.append((s.state, s.health.reasons)))
            runs: list[int] = []

            async def flaky() -> None:
                runs.append(1)
                if len(runs) == 1:
                    raise RuntimeError("boom")
                await asyncio.Event().wait()

            rt.spawn("flaky", flaky)
            await wait_until(lambda: len(runs) == 2, 5, what="flaky restarted")
            assert ("degraded", ("task flaky restarting after: RuntimeError: boom",)) in seen
            await wait_until(lambda: rt.board.snapshot().health.reasons == (), 5, what="flaky stable again")
            assert rt.board.snapshot().health.restarts["tasks"] == 1 and rt.exit_code == 0

            # a loop that returns when it should run on fails too, and one that keeps failing ends the
            # node with EXIT_UNHEALTHY; a loop that may end is left alone
            ended: list[str] = []

            async def returns(tag: str) -> None:
                ended.append(tag)

            rt.spawn("finite", lambda: returns("finite"), may_end=True)
            rt.spawn("returner", lambda: returns("returner"))
            await wait_until(lambda: rt._stop_event.is_set(), 10, what="node asked to stop")
            assert ended.count("finite") == 1 and ended.count("returner") == 3
            assert rt.exit_code == EXIT_UNHEALTHY
            assert rt.board.snapshot().health.reasons == (
                "task returner failed 3 times in 120s (last: it returned); exiting",)

    with caplog.at_level(logging.ERROR, logger="intellect_node.p2p.liveness"):
        run(main(), 60)
    failed = [r for r in caplog.records if r.getMessage() == "task flaky failed"]
    assert failed and failed[0].exc_info is not None  # logged with its traceback


class NotifyListener:
    """A real unix datagram socket standing in for systemd's NOTIFY_SOCKET; records what arrives."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.extend(self.sock.recv(4096).decode().splitlines())
            except socket.timeout:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_systemd_watchdog_pings_only_while_healthy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a ping every 0.2 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setattr("intellect_node.node.runtime.NO_PEERS_DEGRADED_S", 3600.0)  # a lone node, on purpose
    msgs = listener.messages

    async def main() -> None:
        async with runtime_nodes(tmp_path, 1) as (rt,):
            assert rt.notifier.watchdog_s == 0.4
            await wait_until(lambda: msgs.count("WATCHDOG=1") >= 3, 10, what="pings while healthy")
            assert msgs[0] == "READY=1"
            rt.swarm.watch.answer_timeout = 1.0
            rt.swarm.bridge.run_sync_soon(time.sleep, 3.5)  # wedge the trio thread
            await wait_until(lambda: any(m.startswith("STATUS=degraded: libp2p restarting") for m in msgs),
                             10, what="degraded status")
            await wait_until(lambda: rt.swarm.watch.restarts == 1, 20, what="libp2p restarted")
            await wait_until(lambda: "STATUS=running" in msgs[msgs.index(next(
                m for m in msgs if m.startswith("STATUS=degraded"))):], 10, what="running status")
            n = len(msgs)
            await wait_until(lambda: msgs[n:].count("WATCHDOG=1") >= 3, 10, what="pings again")
        first_bad = next(i for i, m in enumerate(msgs) if m.startswith("STATUS=degraded"))
        back = msgs.index("STATUS=running", first_bad)
        assert "WATCHDOG=1" not in msgs[first_bad:back], msgs[first_bad:back]
        assert msgs[-1] == "STOPPING=1" or "STOPPING=1" in msgs[back:]

    try:
        run(main(), 60)
    finally:
        listener.close()


def test_sd_notify_addresses_and_watchdog_pid(tmp_path: Path) -> None:
    assert not Notifier({}).enabled and Notifier({}).ready() is False  # not under systemd: no-op
    name = f"intellect-node-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)  # abstract namespace, as systemd sometimes passes it ("@name")
    sock.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"})
        assert n.watchdog_s is None  # the watchdog was meant for another process
        assert n.ready(status="running")
        assert sock.recv(4096) == b"READY=1\nSTATUS=running"
    finally:
        sock.close()
    nobody = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody.sock")})
    assert nobody.watchdog() is False  # logged, not raised


def test_bridge_fails_waiting_calls_when_its_run_ends_and_starts_again() -> None:
    async def main() -> None:
        bridge = TrioThread(name="test-bridge")
        exits: list[str] = []
        bridge.on_exit = exits.append

        async def root(nursery: trio.Nursery, _b: TrioThread) -> None:
            return None

        await bridge.start(root)
        waiting = asyncio.ensure_future(bridge.call(trio.sleep_forever))

        async def boom() -> None:
            raise ValueError("the run's end")

        await asyncio.sleep(0.05)
        bridge.start_soon(boom)
        with pytest.raises(TransportError):  # "cancelled on the libp2p side"
            await asyncio.wait_for(waiting, 5)
        await wait_until(lambda: exits, 5, what="on_exit")
        assert exits == ["the libp2p thread ended: ValueError: the run's end"] and not bridge.running
        with pytest.raises(TransportError):
            await bridge.call(trio.sleep, 0)

        await bridge.start(root)  # a new run, generation 2
        assert bridge.generation == 2 and bridge.running

        async def answer() -> int:
            return 42

        assert await bridge.call(answer) == 42
        # a wedged run is left behind by stop(); calls waiting on it fail instead of hanging
        stuck = asyncio.ensure_future(bridge.call(trio.sleep_forever))
        await asyncio.sleep(0.05)
        bridge.run_sync_soon(time.sleep, 1.5)
        assert await bridge.astop(join_timeout=0.2) is False
        with pytest.raises(TransportError):
            await asyncio.wait_for(stuck, 5)
        await bridge.start(root)  # while the old thread is still blocked
        assert bridge.generation == 3 and await bridge.call(answer) == 42
        await bridge.astop()

        async def cannot_start(nursery: trio.Nursery, _b: TrioThread) -> None:
            raise OSError("address in use")

        with pytest.raises(OSError, match="address in use"):  # the caller hears of it ...
            await bridge.start(cannot_start)
        await asyncio.sleep(0.1)
        assert exits == ["the libp2p thread ended: ValueError: the run's end"]  # ... on_exit does not

    run(main(), 30)
