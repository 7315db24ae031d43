"""Inbound connection slots (workaround ``inbound-slot-per-connection`` in p2p/compat.py), on real libp2p
hosts on 127.0.0.1.

py-libp2p 0.8.1 takes an inbound slot per connection and returns it only when the whole swarm stops, so
a node that has accepted ``cap`` inbound connections over its life refuses every new peer. With the
mend a slot returns when its connection closes; a refusal at a full cap is counted and the node's status
says it is degraded while the cap is full.

The node's smallest watermarks (low 1, high 1) give an inbound cap of 16: ``max_connections`` is
``max(2 * high, high + 16)`` = 17, less ``min_connections`` = 1 (``p2p.host.connection_config``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from libp2p.network.swarm import Swarm as LibSwarm

from intellect_node.config.status import StatusBoard
from intellect_node.p2p import compat
from intellect_node.p2p.connmgr import ConnLimits
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol.signing import SigningKey
from tests.support.swarm import run
from tests.support.wait import wait_until

LIMITS = ConnLimits(low=1, high=1, grace_s=600.0)
"""Small watermarks, and a grace long enough that the manager trims nobody while a test holds peers."""
CAP = 16


@contextlib.asynccontextmanager
async def node(limits: ConnLimits = LIMITS) -> AsyncIterator[Swarm]:
    sw = await Swarm.start(SigningKey.generate(), run_id="test", listen=["/ip4/127.0.0.1/tcp/0"],
                           http_url="http://127.0.0.1:1", conn=limits)
    try:
        yield sw
    finally:
        await sw.close()


async def _cycle(target: Swarm) -> None:
    """One connect/disconnect cycle from a fresh key; returns once the target holds no slot for it."""
    async with node(ConnLimits(low=1, high=4)) as dialer:
        await dialer.connect(target.listen_addrs()[0])
        await wait_until(lambda: dialer.peer_id in target.connected_peers(), 20, what="target sees dialer")
    await wait_until(lambda: dialer.peer_id not in target.connected_peers(), 20, what="target sees it go")


def test_stock_inbound_handler_keeps_the_slot_of_a_closed_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defect on the stock handler: a connection that closed still holds its slot."""
    stock = compat.stock("Swarm._handle_inbound_connection")
    monkeypatch.setattr(LibSwarm, "_handle_inbound_connection", stock)

    async def main() -> None:
        async with node() as target:
            assert target.inbound().cap == CAP
            await _cycle(target)
            assert target.inbound().in_use == 1  # closed, yet held until the swarm ends

    run(main(), timeout=120)


async def _cycles(target: Swarm, n: int, at_once: int) -> None:
    """``n`` fresh-key cycles, ``at_once`` dialers at a time; returns once every slot is back. At most
    ``at_once`` connections are open at any moment, so a slot kept per closed connection would fill the
    cap by the ``cap + 1``-th cycle and have it refused."""
    async def dialer(share: int) -> None:
        for _ in range(share):
            await _cycle(target)

    await asyncio.gather(*(dialer(n // at_once + (1 if i < n % at_once else 0)) for i in range(at_once)))
    await wait_until(lambda: target.inbound().in_use == 0, 30, what="every slot returns")


def test_cap_plus_one_connect_disconnect_cycles_from_fresh_keys_all_connect() -> None:
    """Cap 16, 17 fresh-key cycles (the last one is the one 0.8.1 refuses), 4 dialers at a time."""
    async def main() -> None:
        async with node() as target:
            assert target.inbound().cap == CAP
            await _cycles(target, CAP + 1, 4)
            assert target.inbound().refused == 0

    run(main(), timeout=300)


def test_at_the_nodes_own_watermarks_cap_plus_one_cycles_all_connect() -> None:
    """The node's default watermarks (cap 124), 125 fresh-key cycles, 8 dialers at a time."""
    from intellect_node.config import build_config

    async def main() -> None:
        async with node(ConnLimits.from_config(build_config())) as target:
            cap = target.inbound().cap
            assert cap == 124
            await _cycles(target, cap + 1, 8)
            assert target.inbound().refused == 0

    run(main(), timeout=300)


def test_a_banned_peers_redials_cost_no_slot() -> None:
    async def main() -> None:
        async with node() as target, node(ConnLimits(low=1, high=4)) as banned:
            await target.ban(banned.peer_id, "test: banned")
            for _ in range(CAP + 1):
                with contextlib.suppress(Exception):  # the dial may succeed, then be closed at once
                    await banned.connect(target.listen_addrs()[0])
                # The banned side sees the close only after the target took the connection and refused it.
                await wait_until(lambda: target.peer_id not in banned.connected_peers(), 20,
                                 what="the target closes the banned peer's connection")
                await wait_until(lambda: target.inbound().in_use == 0, 20, what="the banned peer's slot")
            assert target.inbound().refused == 0  # closed after the handshake, never refused at the cap
            await _cycle(target)  # an honest newcomer still gets in

    run(main(), timeout=300)


def test_a_full_cap_is_counted_logged_and_shown_as_degraded(caplog: pytest.LogCaptureFixture) -> None:
    """Fill the cap on purpose with peers that stay, then one more: it is refused, counted, warned about,
    and the node's status board says it is degraded until a slot is free again."""

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            target = await stack.enter_async_context(node())
            holders = await asyncio.gather(*(stack.enter_async_context(node(ConnLimits(low=1, high=4)))
                                             for _ in range(CAP)))
            await asyncio.gather(*(h.connect(target.listen_addrs()[0]) for h in holders))
            await wait_until(lambda: target.inbound().in_use == CAP, 30, what="the cap fills")
            extra = await stack.enter_async_context(node(ConnLimits(low=1, high=4)))
            with contextlib.suppress(Exception):
                await extra.connect(target.listen_addrs()[0])
            await wait_until(lambda: target.inbound().refused >= 1, 20, what="the refusal is counted")
            slots = target.inbound()
            assert slots.full and extra.peer_id not in target.connected_peers()

            board = StatusBoard()
            _show(board, target)
            snap = board.snapshot()
            assert not snap.healthy and "inbound connection cap full" in " ".join(snap.health.reasons)
            assert snap.peers.inbound_refused == slots.refused

            await holders[0].close()
            await wait_until(lambda: not target.inbound().full, 20, what="a slot is free again")
            _show(board, target)
            assert "inbound connection cap full" not in " ".join(board.snapshot().health.reasons)

    with caplog.at_level("WARNING", logger="intellect_node.p2p.compat"):
        run(main(), timeout=300)
    assert any("inbound connection cap (16) full" in r.getMessage() for r in caplog.records)


def _show(board: StatusBoard, sw: Swarm) -> None:
    """What the runtime's status loop does with the swarm's inbound slots each second."""
    from intellect_node.node.runtime import show_inbound

    show_inbound(board, sw)
