"""Diagnoses that name the cause: a bootstrap address whose host answers with another peer ID is told
apart from one where nothing listens, in what `join` logs and what `doctor` reports (real hosts on
127.0.0.1)."""

from __future__ import annotations

import logging

import pytest

from intellect_node.commands import doctor
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol.signing import SigningKey
from tests.support.swarm import run, swarm_nodes

STALE = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # a peer ID nobody here has


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_doctor_tells_another_peer_id_from_a_host_that_is_down() -> None:
    down = _free_port()

    async def probe() -> tuple[str, list[doctor.Check]]:
        async with swarm_nodes(1) as (target,):
            host_port = target.listen_addrs()[0].split("/p2p/")[0]
            wrong = f"{host_port}/p2p/{STALE}"
            # another ID for the dead address: libp2p dials every address it knows for a peer ID
            gone = SigningKey.generate().peer_id
            checks = await doctor._probe([wrong, f"/ip4/127.0.0.1/tcp/{down}/p2p/{gone}",
                                          target.listen_addrs()[0]], {}, "test")
            return target.peer_id, checks

    real_id, checks = run(probe())
    boot = [c for c in checks if c.name == "bootstrap"]
    assert [c.status for c in boot] == [doctor.FAIL, doctor.FAIL, doctor.OK], boot
    assert f"answered as {real_id}, expected {STALE}" in boot[0].detail
    assert boot[0].detail.startswith("127.0.0.1:") and "peer ID" in boot[0].fix
    assert boot[1].detail.startswith(f"127.0.0.1:{down}: connection refused"), boot[1]


def test_join_logs_the_cause_of_a_failed_bootstrap(caplog: pytest.LogCaptureFixture) -> None:
    async def boot() -> tuple[str, list[str]]:
        async with swarm_nodes(1) as (target,):
            host_port = target.listen_addrs()[0].split("/p2p/")[0]
            sw = await Swarm.start(SigningKey.generate(), run_id="test", listen=["/ip4/127.0.0.1/tcp/0"])
            try:
                reached = await sw.bootstrap([f"{host_port}/p2p/{STALE}"], timeout=15)
            finally:
                await sw.close()
            return target.peer_id, reached

    with caplog.at_level(logging.WARNING, logger="intellect_node.p2p.swarm"):
        real_id, reached = run(boot())
    assert reached == []
    said = [r.getMessage() for r in caplog.records if r.name == "intellect_node.p2p.swarm"]
    assert any(f"answered as {real_id}, expected {STALE}" in m for m in said), said
