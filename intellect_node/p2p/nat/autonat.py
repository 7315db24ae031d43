"""AutoNAT v1 (``/libp2p/autonat/1.0.0``): does the world reach us, asked of several peers.

Server side: a peer asks us to dial it back on the addresses it lists; we dial only addresses whose IP
is the one we observe it at (the spec's amplification guard, kept from the stock server), over a *fresh*
TCP connection with a deadline, and answer OK only when the Noise handshake on that new connection proves
the peer's identity. The stock py-libp2p 0.8.1 server dials back with ``host.connect``, which returns at
once because the request itself arrived on an open connection, so a NATed host and a firewalled public
host were both told PUBLIC (docs/nat.md, "Measured with py-libp2p 0.8.1").

Client side: we list our listen addresses plus a prediction of our NAT mapping (the external IP peers
observe us at, with our listen port: a port-preserving NAT maps the listen port to itself), ask up to
``servers`` peers in parallel, and decide:

    PUBLIC   at least ``min_confirmations`` servers reached us and none failed to (or public outvotes)
    PRIVATE  at least ``min_confirmations`` servers failed to reach us and failures outvote successes
    UNKNOWN  too few verdicts (refusals and time-outs are not verdicts)

Shortcuts: TCP only (the node listens on TCP only); the dial-back connection is never registered in
our swarm (it is upgraded, proven and closed on the spot); a verdict is recomputed from scratch at
every check rather than kept as a sliding window as go-libp2p does.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import trio
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from intellect_node.p2p.compat import AutoNATBase, addr_ip, network_of, observed_external_addrs

logger = logging.getLogger(__name__)

DIAL_BACK_TIMEOUT_S = 5.0
"""Deadline for one dial-back (TCP connect + Noise). A LAN/WAN handshake takes well under 0.1 s; a NAT
that drops the SYN never answers, so this bounds the time to a PRIVATE verdict."""

QUERY_TIMEOUT_S = 12.0
"""Client deadline for one server's answer: covers the server dialling up to a few addresses."""

MAX_CONCURRENT_DIAL_BACKS = 4
"""Server-side cap: dial-backs are outbound work a stranger can ask of us."""

PER_PEER_COOLDOWN_S = 1.0
"""A peer may ask for one dial-back per this many seconds; more are refused (not verdicts). Below the
service's fastest re-check period (3 s), so an honest node is never refused."""

MAX_DIAL_BACK_ADDRS = 4
"""Addresses dialled per request at most (after the observed-IP filter)."""


class Reachability(str, enum.Enum):
    PUBLIC = "PUBLIC"
    PRIVATE = "PRIVATE"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class ReachabilityReport:
    """One AutoNAT verdict, with what the operator should do about it."""

    status: Reachability
    public_addrs: tuple[str, ...] = ()
    """Addresses servers reached us at (PUBLIC only)."""
    successes: int = 0
    failures: int = 0
    no_verdict: int = 0
    """Servers that refused, timed out or could not be reached."""
    listen_port: int | None = None
    checked_at: float = 0.0
    relayed: bool = False
    """Set by the relay client once a reservation is held (the fix text then says so)."""
    fix: str = field(default="")

    def with_fix(self) -> "ReachabilityReport":
        return _replace_fix(self)


def fix_text(status: Reachability, listen_port: int | None, relayed: bool) -> str:
    """The operator-facing advice shown by ``status``, the dashboard and ``doctor``."""
    port = str(listen_port) if listen_port else "N"
    if status is Reachability.PUBLIC:
        return "reachable from the internet; this node can serve as a relay for others"
    if status is Reachability.PRIVATE:
        relay = ("a relay is used meanwhile" if relayed
                 else "no relay reservation yet: peers cannot reach this node until one is made")
        return (f"not reachable from outside: forward TCP port {port} on your router to this machine "
                f"(or open it in the firewall); {relay}")
    return "reachability not known yet: fewer than the required number of peers answered the check"


def _replace_fix(r: ReachabilityReport) -> ReachabilityReport:
    return replace(r, fix=fix_text(r.status, r.listen_port, r.relayed))


def decide(successes: int, failures: int, min_confirmations: int) -> Reachability:
    """The verdict from counts of servers that did and did not reach us (refusals not counted)."""
    if successes >= min_confirmations and successes > failures:
        return Reachability.PUBLIC
    if failures >= min_confirmations and failures > successes:
        return Reachability.PRIVATE
    return Reachability.UNKNOWN


class DialBackAutoNAT(AutoNATBase):
    """The AutoNAT server and client, with the dial-back over a fresh connection with a deadline.

    ``on_reject(peer_id, reason)`` is called for malformed or abusive requests so the node can record
    the reason against the peer.
    """

    def __init__(self, host: BasicHost, *, serve: bool = True, dial_timeout: float = DIAL_BACK_TIMEOUT_S,
                 on_reject: Callable[[str, str], object] | None = None) -> None:
        super().__init__(host, serve=serve, confirmations=1)
        self.dial_timeout = dial_timeout
        self._on_reject = on_reject
        self._dial_slots = trio.Semaphore(MAX_CONCURRENT_DIAL_BACKS)
        self._last_request: dict[ID, float] = {}
        self.unanswered: dict[ID, int] = {}
        """Consecutive queries per server that got no answer (stream failure, time-out); the service
        asks the servers that answer first, so one stuck connection does not stall every round."""

    # --- server -----------------------------------------------------------------------------------

    async def serve_dial(self, message: Message, observed_ip: str | None, is_relayed: bool) -> Message:
        try:
            requester = ID(message.dial.peer.id)
        except Exception:
            return self._refuse(None, "dial request names no valid peer ID", Message.E_BAD_REQUEST)
        now = time.monotonic()
        last = self._last_request.get(requester)
        if last is not None and now - last < PER_PEER_COOLDOWN_S:
            return self._refuse(requester, "dial-back requested again within the cool-down")
        self._last_request[requester] = now
        if len(self._last_request) > 4096:  # bounded memory against peer-ID churn
            cutoff = now - PER_PEER_COOLDOWN_S
            self._last_request = {p: t for p, t in self._last_request.items() if t >= cutoff}
        if self._dial_slots.value == 0:
            return self._refuse(None, "too many dial-backs in progress")
        async with self._dial_slots:
            return await self.stock_serve_dial(message, observed_ip, is_relayed)

    def _refuse(self, peer: ID | None, reason: str,
                status: Message.ResponseStatus.ValueType = Message.E_DIAL_REFUSED) -> Message:
        logger.info("autonat request from %s refused: %s", peer, reason)
        if peer is not None and self._on_reject is not None and status == Message.E_BAD_REQUEST:
            self._on_reject(str(peer), f"autonat: {reason}")
        response = Message()
        response.type = Message.DIAL_RESPONSE
        response.dialResponse.status = status
        response.dialResponse.statusText = reason
        return response

    async def dial_back(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        """Dial ``peer_id`` on a new TCP connection and prove its identity with Noise; never reuse one."""
        network = network_of(self.host)
        for raw in addrs[:MAX_DIAL_BACK_ADDRS]:
            t0 = time.monotonic()
            try:
                maddr = Multiaddr(raw)
                if "/p2p-circuit" in str(maddr):
                    continue
                transport = network.transport_manager.transport_for_dialing(maddr)
                if transport is None:
                    continue
                with trio.fail_after(self.dial_timeout):
                    raw_conn = await transport.dial(maddr)
                    try:
                        secured = await network.upgrader.upgrade_security(raw_conn, True, peer_id)
                        # Finish the muxer handshake too, then close: a connection abandoned half-way
                        # left the requester's swarm with a broken entry for us, and its next streams
                        # to us hung in negotiation (seen with full nodes in namespaces).
                        muxed = await network.upgrader.upgrade_connection(secured, peer_id)
                    except BaseException:
                        await raw_conn.close()
                        raise
                    await muxed.close()
                logger.debug("autonat dial-back to %s reached it in %.2fs", peer_id, time.monotonic() - t0)
                return bytes(raw)
            except trio.TooSlowError:
                logger.info("autonat dial-back to %s timed out after %.1fs", peer_id, time.monotonic() - t0)
            except Exception as exc:  # per-address edge: any failure means "not reachable there"
                logger.info("autonat dial-back to %s failed after %.1fs: %r", peer_id,
                            time.monotonic() - t0, exc)
        return None

    # --- client -----------------------------------------------------------------------------------

    def candidate_addrs(self) -> list[Multiaddr]:
        """Our listen addresses plus predicted NAT mappings (observed external IP + listen port)."""
        listen = [a for a in self.host.get_transport_addrs() if "/p2p-circuit" not in str(a)]
        out: dict[str, Multiaddr] = {}
        for a in listen:
            ip = addr_ip(a)
            if ip in (None, "0.0.0.0", "::") or ip.startswith("127."):
                continue
            out[str(a)] = a
        external_ips: list[str] = []
        for obs in observed_external_addrs(self.host):
            ip = addr_ip(obs)
            if ip and ip not in external_ips:
                external_ips.append(ip)
        for ip in external_ips:
            for a in listen:
                port = a.value_for_protocol("tcp")
                m = Multiaddr(f"/ip4/{ip}/tcp/{port}")
                out.setdefault(str(m), m)
        return list(out.values())

    async def check(self, servers: Iterable[ID], *, min_confirmations: int = 2,
                    query_timeout: float = QUERY_TIMEOUT_S, relayed: bool = False) -> ReachabilityReport:
        """Ask every server in parallel and return the verdict (never raises for a server's failure)."""
        servers = [s for s in servers if s != self.host.get_id()]
        addrs = [a.to_bytes() for a in self.candidate_addrs()]
        results: dict[ID, tuple[int, bytes | None] | None] = {}

        async def ask(server: ID) -> None:
            try:
                results[server] = await self.query_server(server, addrs=addrs, timeout=query_timeout)
                self.unanswered.pop(server, None)
            except (Exception, trio.TooSlowError) as exc:
                logger.info("autonat query to %s failed: %r", server, exc)
                results[server] = None
                self.unanswered[server] = self.unanswered.get(server, 0) + 1

        if addrs:
            async with trio.open_nursery() as nursery:
                for s in servers:
                    nursery.start_soon(ask, s)
        successes = failures = no_verdict = 0
        reached: list[str] = []
        for res in results.values():
            if res is None:
                no_verdict += 1
            elif res[0] == Message.OK:
                successes += 1
                if res[1]:
                    try:
                        reached.append(str(Multiaddr(res[1])))
                    except Exception:
                        pass
            elif res[0] == Message.E_DIAL_ERROR:
                failures += 1
            else:
                no_verdict += 1
        status = decide(successes, failures, min_confirmations)
        self.status = {Reachability.PUBLIC: 1, Reachability.PRIVATE: 2}.get(status, 0)
        ports = [int(a.value_for_protocol("tcp")) for a in self.host.get_transport_addrs()
                 if "/tcp/" in str(a)]
        report = ReachabilityReport(
            status=status, public_addrs=tuple(sorted(set(reached))) if status is Reachability.PUBLIC else (),
            successes=successes, failures=failures,
            no_verdict=no_verdict + (len(servers) if not addrs else 0),
            listen_port=ports[0] if ports else None, checked_at=time.time(), relayed=relayed)
        return report.with_fix()
