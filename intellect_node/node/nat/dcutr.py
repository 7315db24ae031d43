"""DCUtR (``/libp2p/dcutr``): turn a relayed connection into a direct one by a TCP simultaneous open.

py-libp2p 0.8.1's ``DCUtRProtocol`` does the exchange (CONNECT with observed addresses, SYNC, both
sides dialling from their listen port); this module runs it with a short dial timeout and keeps score.
Measured in namespaces (shared/notes/nat-traversal.md): with ``dial_timeout=2`` a direct connection
took about 2.7 s (10.5 s with the default 10 s, spent dialling unreachable private addresses); punches
succeed when both NATs keep the source port and drop unsolicited packets, and fail when a NAT
randomises ports or answers with RST. Then the relayed connection simply stays the path.

The stock protocol also drives punches on its own for every relayed peer (every 2 s, at most three
attempts per peer), so a peer that connected through a relay is upgraded without anyone asking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service

from intellect_node.node.nat.relay import connection_kinds

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 2
"""Per-address dial deadline during a punch (measured: 2 s gives ~2.7 s to direct, 10 s gives 10.5 s)."""

UPGRADE_TIMEOUT_S = 30.0
"""Whole-upgrade bound: three rounds of 5 s plus the exchange, with slack."""


@dataclass(frozen=True)
class HolePunchSnapshot:
    attempts: int
    direct: int
    failed: int


class HolePuncher:
    """Runs the DCUtR service; ``upgrade(peer)`` asks for a direct connection now."""

    def __init__(self, host: Any, dial_timeout: int = DIAL_TIMEOUT_S) -> None:
        self.host = host
        self.protocol = DCUtRProtocol(host, dial_timeout=dial_timeout)
        self.attempts = 0
        self.direct = 0
        self.failed = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            await self.protocol.event_started.wait()
            task_status.started()
            await trio.sleep_forever()

    async def upgrade(self, peer: ID) -> bool:
        """True when a direct connection to ``peer`` exists afterwards (punched or already there)."""
        kinds = connection_kinds(self.host, peer)
        if "direct" in kinds:
            return True
        if not kinds:
            return False
        self.attempts += 1
        ok = False
        with trio.move_on_after(UPGRADE_TIMEOUT_S):
            ok = await self.protocol.initiate_hole_punch(peer)
        # The stock auto-drive may have won the race: trust the connection table, not the return value.
        ok = ok or "direct" in connection_kinds(self.host, peer)
        if ok:
            self.direct += 1
        else:
            self.failed += 1
            logger.info("hole punch to %s failed; the relay stays the path", peer)
        return ok

    def snapshot(self) -> HolePunchSnapshot:
        return HolePunchSnapshot(attempts=self.attempts, direct=self.direct, failed=self.failed)
