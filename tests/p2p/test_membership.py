"""Membership that scales: heartbeat intervals stretch with the swarm, receivers time a
stretched peer out by its own interval, and liveness holds with fewer connections than peers.

The rule and the wire format are checked as pure functions; the behaviour on ten real nodes
(``NodeRuntime`` s with libp2p hosts on 127.0.0.1) whose watermarks are far below the swarm's size:
the trainer keeps the base interval, workers stretch, every node learns the trainer is alive, the
trainer tracks every worker, and a frozen and a stopped worker are marked gone within the bound.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from intellect_node.config import build_config
from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.p2p.heartbeat import stretched_interval, timeout_for
from intellect_node.p2p.identity import init_key
from intellect_node.p2p.peerbook import PeerBook
from intellect_node.protocol import codec, gossip
from intellect_node.protocol.signing import SigningKey
from tests.support.swarm import run
from tests.support.wait import wait_until

KEY = SigningKey(bytes(range(32)))
NOW = 1_800_000_000_000


# -- the rule ----------------------------------------------------------------------------------------


def test_the_interval_stretches_with_the_swarm_so_the_rate_a_node_sees_stays_flat() -> None:
    base, k, cap = 5.0, 10, 3600.0
    for n in (1, 5, 10):
        assert stretched_interval(base, n, stretch_above=k, max_interval=cap) == base
    assert stretched_interval(base, 20, stretch_above=k, max_interval=cap) == 10.0
    assert stretched_interval(base, 1000, stretch_above=k, max_interval=cap) == 500.0
    # The rate a node receives from n peers all following the rule: n / interval, flat at k / base.
    for n in (11, 48, 100, 1000, 7200):
        assert n / stretched_interval(base, n, stretch_above=k, max_interval=cap) == pytest.approx(k / base)
    # Past the cap it grows again, by n / cap (10,000 nodes: 2.8/s instead of 2/s).
    assert stretched_interval(base, 10_000, stretch_above=k, max_interval=cap) == cap
    assert stretched_interval(base, 50, stretch_above=k, max_interval=1.0) == base  # a cap below base


def test_a_receiver_times_a_stretched_peer_out_after_as_many_of_its_intervals() -> None:
    kw = dict(interval=5.0, peer_timeout=20.0, max_interval=3600.0)
    assert timeout_for(None, **kw) is None  # an old or unstretched peer: peer_timeout
    assert timeout_for(5.0, **kw) is None and timeout_for(1.0, **kw) is None
    assert timeout_for(24.0, **kw) == 96.0  # four of its intervals, as peer_timeout is four of ours
    assert timeout_for(86_400.0, **kw) == 20.0 * 3600 / 5  # honoured up to our max_interval only


def test_the_peerbook_times_each_peer_by_its_own_timeout() -> None:
    book = PeerBook("me", peer_timeout=2.0)
    t0 = time.monotonic()
    assert book.heard("plain", roles=["worker"]) and book.heard("slow", roles=["worker"], timeout=10.0)
    assert book.heard("trainer", roles=["trainer"])
    assert book.count_alive() == 3 and book.count_alive(without_roles=frozenset({"trainer"})) == 2
    assert book.sweep(t0 + 3.0) == ["plain", "trainer"]
    assert book.state("slow") == "alive" and book.sweep(t0 + 11.0) == ["slow"]
    # A peer that stops stretching is timed by peer_timeout again from its next heartbeat.
    assert book.heard("slow", roles=["worker"])
    assert book.sweep(time.monotonic() + 3.0) == ["slow"]


class OldHeartbeat(codec.Message, frozen=True):
    """The heartbeat of the previous release, field for field (no ``interval_ms``)."""

    run_id: str
    seq: int
    time_ms: int
    http_url: str
    listen_addrs: list[str]
    roles: list[str] = []


def _fields() -> dict[str, Any]:
    return dict(run_id="r1", seq=3, time_ms=NOW, http_url="http://127.0.0.1:1",
                listen_addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{KEY.peer_id}"], roles=["worker"])


def test_the_wire_stays_compatible_both_ways() -> None:
    # An old node's heartbeat parses, as unstretched.
    old = KEY.seal(gossip.HEARTBEAT_DOMAIN, OldHeartbeat(**_fields()))
    hb, _ = gossip.open_heartbeat(old, run_id="r1", now_ms=NOW)
    assert hb.interval_ms is msgspec.UNSET
    # An unstretched heartbeat is byte for byte what the old release sends, so old nodes accept it.
    assert codec.encode(gossip.Heartbeat(**_fields())) == codec.encode(OldHeartbeat(**_fields()))
    # A stretched one carries its interval; nonsense intervals are refused.
    def sealed(interval_ms: int) -> bytes:
        return KEY.seal(gossip.HEARTBEAT_DOMAIN, gossip.Heartbeat(**_fields(), interval_ms=interval_ms))

    hb, _ = gossip.open_heartbeat(sealed(24_000), run_id="r1", now_ms=NOW)
    assert hb.interval_ms == 24_000
    for bad in (0, -1, gossip.MAX_INTERVAL_MS + 1):
        with pytest.raises(ProtocolError, match="interval"):
            gossip.open_heartbeat(sealed(bad), run_id="r1", now_ms=NOW)


def test_config_errors_name_the_field() -> None:
    cfg = build_config()
    assert (cfg.network.heartbeat_stretch_above, cfg.network.heartbeat_max_interval) == (10, 3600.0)
    with pytest.raises(ConfigError, match="heartbeat_max_interval"):
        build_config(network={"heartbeat_interval": 10, "peer_timeout": 40, "heartbeat_max_interval": 5})
    with pytest.raises(ConfigError, match="heartbeat_stretch_above"):
        build_config(network={"heartbeat_stretch_above": 0})


# -- ten real nodes, watermarks far below the swarm's size ---------------------------------------------

BASE_S = 1.0
PEER_TIMEOUT_S = 4.0
"""Four intervals, as the defaults (20 s at 5 s)."""
STRETCH_ABOVE = 4
WORKERS = 9
WORKER_INTERVAL_S = BASE_S * WORKERS / STRETCH_ABOVE  # 2.25 s once a worker hears the other eight
WORKER_TIMEOUT_S = PEER_TIMEOUT_S * WORKER_INTERVAL_S / BASE_S  # 9 s at every receiver
SWEEP_S = min(BASE_S, PEER_TIMEOUT_S / 4)
GONE_BOUND_S = WORKER_TIMEOUT_S + SWEEP_S + WORKER_INTERVAL_S  # after the victim's last expected beat


def _node(root: Path, i: int, trainer: str, bootstrap: list[str], low: int, high: int) -> Any:
    from intellect_node.node.assembly import build_node

    cfg = build_config(network={"heartbeat_interval": BASE_S, "peer_timeout": PEER_TIMEOUT_S,
                                "heartbeat_stretch_above": STRETCH_ABOVE, "http_host": "127.0.0.1",
                                "conn_low": low, "conn_high": high, "conn_grace_s": 1.0,
                                "bootstrap": bootstrap},
                       run={"run_id": "members", "trainer_peer_id": trainer})
    labels = ["trainer"] if i == 0 else ["worker"]
    return build_node(cfg, root / f"node{i}", labels=labels, services=[], common=False)


@pytest.mark.timeout(300)
def test_ten_nodes_with_few_connections_track_each_other_and_mark_the_silent_gone(tmp_path: Path) -> None:
    """A trainer and nine workers join through the trainer (trainer: low 3, high 4; workers: low 3,
    high 8): the trainer trims, nobody is connected to everyone, yet every worker hears the trainer
    (base interval) and the trainer hears all nine workers (stretched to 2.25 s and announced). A worker
    whose heartbeats stop while its connections stay up (as a frozen process looks) and, at the same
    time, one that stops are each marked gone by everyone else within the bound; the trainer stays
    alive for the rest."""
    trainer_id = init_key(tmp_path / "node0").peer_id

    async def main() -> None:
        rts: list[Any] = []
        gone: dict[str, list[str]] = {}
        try:
            trainer = _node(tmp_path, 0, trainer_id, [], low=3, high=4)
            await trainer.start()
            rts.append(trainer)
            boot = trainer.swarm.listen_addrs()[:1]
            for i in range(1, WORKERS + 1):  # one after the other, as nodes join
                rt = _node(tmp_path, i, trainer_id, boot, low=3, high=8)
                await rt.start()
                rts.append(rt)
            for rt in rts:
                gone[rt.swarm.peer_id] = []
                rt.heartbeats.on_gone.append(gone[rt.swarm.peer_id].append)
            workers = rts[1:]
            ids = [rt.swarm.peer_id for rt in workers]

            await wait_until(lambda: trainer.swarm.connmgr.trims >= 1, 60, what="the trainer trims")
            await wait_until(lambda: set(ids) <= set(trainer.swarm.peerbook.alive_peers()), 60,
                             what="the trainer hears all nine workers")
            await wait_until(lambda: all(rt.swarm.peerbook.state(trainer_id) == "alive" for rt in workers),
                             60, what="every worker hears the trainer")
            # 2.25 s once a worker counts all nine; a worker that missed a few heartbeats on a starved
            # machine counts one less for a moment, so the wait asks for the stretch, not the value.
            await wait_until(lambda: all(BASE_S < rt.heartbeats.current_interval <= WORKER_INTERVAL_S
                                         for rt in workers), 60, what="every worker stretched its interval")
            assert trainer.heartbeats.current_interval == BASE_S and trainer.heartbeats.fixed_rate
            await wait_until(lambda: all(PEER_TIMEOUT_S < (_timeout(trainer, p) or 0) <= WORKER_TIMEOUT_S
                                         for p in ids), 30,
                             what="the trainer times workers by their announced interval")
            await wait_until(lambda: all(len(rt.swarm.connected_peers()) <= 8 for rt in rts)
                             and len(trainer.swarm.connected_peers()) <= 4, 60,
                             what="every node at or under its high watermark")
            assert not any(len(rt.swarm.connected_peers()) == WORKERS for rt in rts)
            assert trainer.status()["heartbeats"]["swarm_estimate"] == WORKERS + 1

            # Frozen: heartbeats stop, connections and forwarding go on. Stopped: its host closes. Both at
            # once, each timed out by everyone else on its own.
            frozen, stopped = workers[0], workers[1]
            await frozen.heartbeats.stop()
            await stopped.stop()
            rts.remove(stopped)
            others = [rt for rt in rts if rt is not frozen]
            await wait_until(lambda: all(rt.swarm.peerbook.state(frozen.swarm.peer_id) == "gone"
                                         for rt in others),
                             GONE_BOUND_S + 30, what="the frozen worker marked gone by everyone")
            assert all(frozen.swarm.peer_id in gone[rt.swarm.peer_id] for rt in others)  # on_gone told them
            await wait_until(lambda: all(rt.swarm.peerbook.state(stopped.swarm.peer_id) == "gone"
                                         for rt in others),
                             GONE_BOUND_S + 30, what="the stopped worker marked gone by everyone")
            # (On a starved machine a worker may miss four of the trainer's 1 s heartbeats in a row and
            # mark it gone for a moment; what must hold is that it is alive for everyone afterwards.)
            await wait_until(lambda: all(rt.swarm.peerbook.state(trainer_id) == "alive"
                                         for rt in workers[2:]),
                             60, what="the trainer alive at every remaining worker")
        finally:
            # Each stop bounded, as `serve` bounds a node's: on a machine at load ~50, stopping ten
            # in-process nodes at once took over a minute (one GIL, ten trio threads closing).
            await asyncio.gather(*(asyncio.wait_for(rt.stop(), 60) for rt in rts), return_exceptions=True)

    run(main(), timeout=280)


def _timeout(rt: Any, peer: str) -> float | None:
    return next((r["timeout_s"] for r in rt.swarm.peerbook.snapshot() if r["peer_id"] == peer), None)
