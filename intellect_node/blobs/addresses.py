"""Which addresses this node fetches blobs from: a peer's URL may only lead back to that peer.

A provider's HTTP URL is the peer's own word (its heartbeat, its node info). Fetched as given, it would
let any key make this node send requests to any host and port (a blind request forger) and learn from
the failures which ports answer (a port scanner). So before a request goes out, the address the URL
resolves to must be one of the provider's own:

1. an address its libp2p connection to this node came from (now or before; ``connected``), or
2. an address it announced in its signed listen addresses (``announced``), if that address is public
   and the peer proved it is there: this node dialled the peer's libp2p at that address and the Noise
   handshake answered with the peer's key (:meth:`AddressPolicy.prove`, once per peer and address in
   :data:`PROOF_RETRY_S`). A signature over an address proves only that the peer typed it: without the
   dial, any key could announce a third party's public host and have every node that fetches from it
   send requests there.

and its kind must fit:

- public (globally routable) addresses: either of the above (an announced one once proven; a peer
  already connected from another address is not dialled again, so only its connection's address
  counts);
- loopback, private (RFC 1918, unique-local, shared 100.64/10) and link-local addresses: only an
  address the peer is connected from, and only when this node itself has an address of that kind (its
  advertised URL or a listen address; a node that advertises no concrete address, such as a wildcard
  listener behind NAT reached through a relay, by the kind of its route to the peer, loopback excepted):
  nodes on one machine or one LAN fetch from each other (every test runs on 127.0.0.1), a peer on the
  internet cannot point this node into its own machine or LAN;
- unspecified, multicast and reserved addresses: never.

The check runs on the address a name resolved to, just before the request (``HttpChunkSource``), so a
DNS name cannot point elsewhere than the address checked. A refusal is a :class:`AddressRefused`: a
failed source for that provider, like a refused connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from intellect_node.errors import TransportError

if TYPE_CHECKING:
    from intellect_node.p2p.swarm import Swarm

PROOF_RETRY_S = 600.0
"""How long a failed proof of an announced public address stands before the address is dialled again."""
MAX_PROOFS_KEPT = 1024
PROOF_TIMEOUT_S = 5.0

_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: not global, not "private" in 3.11


class AddressRefused(TransportError):
    """A provider URL resolved to an address that is not the provider's own (see the module docstring)."""


def kind(ip: str) -> str:
    """``global``, ``loopback``, ``private``, ``link-local`` or ``forbidden`` (not an address, unspecified,
    multicast, reserved)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return "forbidden"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return "loopback"
    if addr.is_unspecified or addr.is_multicast or addr.is_reserved:
        return "forbidden"
    if addr.is_link_local:
        return "link-local"
    if addr.is_global:
        return "global"
    if addr.is_private or (isinstance(addr, ipaddress.IPv4Address) and addr in _SHARED):
        return "private"
    return "forbidden"  # documentation, benchmarking and other special ranges


def ip_of_multiaddr(addr: str) -> str | None:
    """The IP of ``/ip4/<a>/...`` or ``/ip6/<a>/...``; None for anything else (DNS, relay circuits)."""
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in parts:
        return parts[2]
    return None


def host_of_url(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


@dataclass(frozen=True)
class PeerAddresses:
    """What this node knows of one peer's addresses."""

    connected: frozenset[str] = frozenset()
    """IPs its libp2p connections to this node came from."""
    announced: frozenset[str] = frozenset()
    """IPs of the listen addresses it signed (heartbeats, node info)."""


class AddressPolicy:
    """``refusal(peer_id, ip)``: why this node must not send a request for ``peer_id`` to ``ip`` ("" when
    it may). ``own()`` lists this node's own addresses (URLs, multiaddrs or plain IPs), ``peer(peer_id)``
    what it knows of the peer's."""

    def __init__(self, own: Callable[[], Iterable[str]], peer: Callable[[str], PeerAddresses],
                 dial: Callable[[str, str], Awaitable[bool]] | None = None) -> None:
        self._own = own
        self._peer = peer
        self._dial = dial
        """``dial(peer_id, ip)``: connect to the peer's libp2p at an address it announced with ``ip``;
        True when the peer answered there (its connection then counts as ``connected``)."""
        self._failed: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.proofs = {"proven": 0, "failed": 0}

    @classmethod
    def from_swarm(cls, swarm: Swarm) -> "AddressPolicy":
        """This node's advertised URL and listen addresses; the peerbook's view of each peer; proofs by
        dialling the peer's announced multiaddr through the swarm."""
        def peer(peer_id: str) -> PeerAddresses:
            connected, announced = swarm.peerbook.addresses(peer_id)
            return PeerAddresses(frozenset(connected), frozenset(announced))

        async def dial(peer_id: str, ip: str) -> bool:
            for addr in swarm.peerbook.announced_addrs(peer_id)[:8]:
                if ip_of_multiaddr(addr) != ip:
                    continue
                target = addr if "/p2p/" in addr else f"{addr}/p2p/{peer_id}"
                try:
                    async with asyncio.timeout(PROOF_TIMEOUT_S):
                        if await swarm.connect(target) != peer_id:
                            continue
                except (TransportError, TimeoutError):
                    continue
                # libp2p keeps one connection a peer: a peer already connected from elsewhere is not
                # dialled again, and only an address its connection came from counts
                if ip in swarm.peerbook.addresses(peer_id)[0]:
                    return True
            return False

        return cls(lambda: [swarm.http_url, *swarm.listen_addrs()], peer, dial)

    def needs_proof(self, peer_id: str, ip: str) -> bool:
        """Whether ``ip`` is a public address ``peer_id`` announced but has not been connected from: the
        one refusal a proof (:meth:`prove`) can lift."""
        if kind(ip) != "global":
            return False
        known = self._peer(peer_id)
        bare = ip.split("%", 1)[0]
        return bare in known.announced and bare not in known.connected

    async def prove(self, peer_id: str, ip: str) -> bool:
        """Dial ``peer_id`` at the announced public ``ip`` (not again within :data:`PROOF_RETRY_S` of a
        failure); True when it answered there with its own key."""
        if self._dial is None:
            return False
        key = (peer_id, ip.split("%", 1)[0])
        failed_at = self._failed.get(key)
        if failed_at is not None and time.monotonic() - failed_at < PROOF_RETRY_S:
            return False
        ok = await self._dial(peer_id, key[1])
        self.proofs["proven" if ok else "failed"] += 1
        if ok:
            self._failed.pop(key, None)
        else:
            self._failed[key] = time.monotonic()
            self._failed.move_to_end(key)
            while len(self._failed) > MAX_PROOFS_KEPT:
                self._failed.popitem(last=False)
        return ok

    def own_kinds(self) -> set[str]:
        out = set()
        for a in self._own():
            ip = ip_of_multiaddr(a) if a.startswith("/") else host_of_url(a) if "://" in a else a
            if ip:
                out.add(kind(ip))
        out.discard("forbidden")  # a wildcard listen address says nothing about where this node runs
        return out

    def refusal(self, peer_id: str, ip: str) -> str:
        k = kind(ip)
        if k == "forbidden":
            return f"{ip} is not an address to fetch from"
        known = self._peer(peer_id)
        bare = ip.split("%", 1)[0]
        if k == "global":
            if bare in known.connected:
                return ""
            if bare in known.announced:
                return f"public address {ip} the peer announced is not proven (no libp2p answered there)"
            return f"{ip} is neither where the peer is connected from nor a public address it announced"
        if bare not in known.connected:
            return f"{k} address {ip} is not where the peer is connected from"
        own = self.own_kinds()
        # A node that advertises no concrete address (a wildcard listener reached through a relay) says
        # where it runs by its route to the peer; never for loopback, which a local proxy would make every
        # peer's address.
        if k not in own and (own or k == "loopback" or kind(source_address(bare)) != k):
            return f"{k} address {ip}: this node has no {k} address of its own"
        return ""


def source_address(ip: str) -> str:
    """The address this machine would send from to reach ``ip`` (the kernel's route; nothing is sent), or
    "" when there is no route. A node listening on a wildcard address (``0.0.0.0``) or reachable only
    through a relay advertises nothing of the kind of network it sits on; its route to a peer says it."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0]).split("%", 1)[0]
    except OSError:
        return ""

