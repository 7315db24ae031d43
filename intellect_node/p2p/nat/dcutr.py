"""DCUtR (``/libp2p/dcutr``): turn a relayed connection into a direct one by a TCP simultaneous open.

py-libp2p 0.8.1's ``DCUtRProtocol`` does the exchange (CONNECT with observed addresses, SYNC, both
sides dialling from their listen port); this module runs it with a short dial timeout and keeps score.
Measured in namespaces (docs/nat.md, "Measured with py-libp2p 0.8.1"): with ``dial_timeout=2`` a
direct connection took about 2.7 s (10.5 s with the default 10 s, spent dialling unreachable private
addresses); punches succeed when both NATs keep the source port and drop unsolicited packets, and fail
when a NAT randomises ports or answers with RST. Then the relayed connection simply stays the path.

The stock protocol also drives punches on its own for every relayed peer (every 2 s, at most three
attempts per peer), so a peer that connected through a relay is upgraded without anyone asking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from intellect_node.p2p.compat import DCUtRBase, observed_external_addrs
from intellect_node.p2p.nat.relay import OWN_ADDRS_VIEW, connection_kinds, relay_of_connection

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 2
"""Per-address dial deadline during a punch (measured: 2 s gives ~2.7 s to direct, 10 s gives 10.5 s)."""

MAX_REMEMBERED_IPS = 4
AUTO_DRIVE_PERIOD_S = 0.5
DRIVING_SIDE = "inbound"
"""Which end of a relayed connection starts the punch: the one that accepted it (B in the DCUtR spec).
One driver per connection; the stock library drove from both ends (see ``_auto_drive_loop``)."""
PEER_START_GRACE_S = 3.0
"""How long the dialer of a relayed connection waits for the listener to start the punch."""

UPGRADE_TIMEOUT_S = 30.0
"""Whole-upgrade bound: three rounds of 5 s plus the exchange, with slack."""


@dataclass(frozen=True)
class HolePunchSnapshot:
    attempts: int
    direct: int
    failed: int


def has_direct(host: IHost, peer: ID) -> bool:
    return "direct" in connection_kinds(host, peer)


def relayed_direction(host: IHost, peer: ID) -> str | None:
    """``"inbound"``/``"outbound"`` for our relayed connection to ``peer`` (None without one)."""
    for conn in host.get_network().get_connections(peer):
        if getattr(conn, "is_closed", False) or relay_of_connection(conn) is None:
            continue
        initiator = getattr(getattr(conn, "muxed_conn", None), "is_initiator", None)
        if initiator is not None:
            return "outbound" if initiator else "inbound"
    return None


class _RememberingDCUtR(DCUtRBase):
    """Stock DCUtR whose CONNECT never goes out empty.

    The stock protocol predicts our dialable address from identify observations (external IP + listen
    port), but observations live only as long as the connection that reported them; when those
    connections have closed it falls back to ``host.get_addrs()``, which for a private node holds only
    circuit addresses (see relay.advertise_circuit_addrs), and the peer gets nothing to dial. So the
    external IPs ever observed are remembered and used when no live observation exists.
    """

    def __init__(self, host: IHost, dial_timeout: int) -> None:
        super().__init__(host, dial_timeout=dial_timeout)
        self.external_ips: dict[str, None] = {}

    def remember_observations(self) -> None:
        for obs in observed_external_addrs(self.host):
            try:
                self.external_ips[obs.value_for_protocol("ip4")] = None
            except Exception:  # an ip6 or odd observation: not used for TCP punching here
                continue

    async def auto_drive_loop(self) -> None:
        """Punch for relayed connections we *accepted*, as the DCUtR spec has it (the listener B starts).

        The stock loop starts a session for every relayed peer on both ends; two concurrent sessions
        then dial the same address pair from the same port, the surviving socket on each end may belong
        to a session whose handshake role does not match the other end's, and the punch times out. Seen
        in namespaces; one initiator per connection fixes it.
        """
        while True:
            await trio.sleep(AUTO_DRIVE_PERIOD_S)
            for peer in list(self.host.get_network().connections.keys()):
                if self.settled(peer):
                    continue
                if relayed_direction(self.host, peer) == DRIVING_SIDE and not has_direct(self.host, peer):
                    await self.initiate_hole_punch(peer)

    async def perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr],
                                 as_responder: bool = False) -> bool:
        # The stock code finds the listen port to dial from in host.get_addrs(), which on a private node
        # lists only circuit addresses (relay.advertise_circuit_addrs): show it the real ones. Without
        # the bound source port the NAT picks a random one and the punch cannot meet.
        token = OWN_ADDRS_VIEW.set(True)
        try:
            return await super().perform_hole_punch(peer_id, addrs, as_responder)
        finally:
            OWN_ADDRS_VIEW.reset(token)

    async def observed_addrs(self) -> list[bytes]:
        self.remember_observations()
        addrs = await super().observed_addrs()
        if addrs:
            return addrs
        out = []
        for ip in list(self.external_ips)[-MAX_REMEMBERED_IPS:]:
            for a in self.host.get_transport_addrs():
                port = a.value_for_protocol("tcp")
                if port:
                    out.append(Multiaddr(f"/ip4/{ip}/tcp/{port}").to_bytes())
        return out


class HolePuncher:
    """Runs the DCUtR service; ``upgrade(peer)`` asks for a direct connection now."""

    def __init__(self, host: IHost, dial_timeout: int = DIAL_TIMEOUT_S) -> None:
        self.host = host
        self.protocol = _RememberingDCUtR(host, dial_timeout=dial_timeout)
        self.attempts = 0
        self.direct = 0
        self.failed = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            await self.protocol.event_started.wait()
            task_status.started()
            while True:  # observations vanish with their connections: sample them while they exist
                self.protocol.remember_observations()
                await trio.sleep(1.0)

    async def upgrade(self, peer: ID) -> bool:
        """True when a direct connection to ``peer`` exists afterwards (punched or already there).

        On a relayed connection we dialled, the listener starts the punch (spec, and our auto-drive):
        wait for its session; start one ourselves only if none came within PEER_START_GRACE_S.
        """
        kinds = connection_kinds(self.host, peer)
        if "direct" in kinds:
            return True
        if not kinds:
            return False
        self.attempts += 1
        proto = self.protocol
        with trio.move_on_after(UPGRADE_TIMEOUT_S):
            if relayed_direction(self.host, peer) not in (DRIVING_SIDE, None):
                with trio.move_on_after(PEER_START_GRACE_S):
                    while not proto.in_progress(peer) and not has_direct(self.host, peer):
                        await trio.sleep(0.05)
            if not proto.in_progress(peer) and not has_direct(self.host, peer):
                await proto.initiate_hole_punch(peer)
            while proto.in_progress(peer) and not has_direct(self.host, peer):
                await trio.sleep(0.1)
        ok = has_direct(self.host, peer)
        if ok:
            self.direct += 1
        else:
            self.failed += 1
            logger.info("hole punch to %s failed; the relay stays the path", peer)
        return ok

    def snapshot(self) -> HolePunchSnapshot:
        return HolePunchSnapshot(attempts=self.attempts, direct=self.direct, failed=self.failed)
