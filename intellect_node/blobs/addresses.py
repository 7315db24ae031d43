"""Which addresses this node fetches blobs from: a peer's URL may only lead back to that peer.

A provider's HTTP URL is the peer's own word (its heartbeat, its node info). Fetched as given, it would
let any key make this node send requests to any host and port (a blind request forger) and learn from
the failures which ports answer (a port scanner). So before a request goes out, the address the URL
resolves to must be one of the provider's own:

1. an address its libp2p connection to this node came from (now or before; ``connected``), or
2. an address it announced in its signed listen addresses (``announced``), if that address is public.

and its kind must fit:

- public (globally routable) addresses: either of the above;
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

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from intellect_node.errors import TransportError

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

    def __init__(self, own: Callable[[], Iterable[str]], peer: Callable[[str], PeerAddresses]) -> None:
        self._own = own
        self._peer = peer

    @classmethod
    def from_swarm(cls, swarm: Any) -> "AddressPolicy":
        """This node's advertised URL and listen addresses; the peerbook's view of each peer."""
        def peer(peer_id: str) -> PeerAddresses:
            connected, announced = swarm.peerbook.addresses(peer_id)
            return PeerAddresses(frozenset(connected), frozenset(announced))

        return cls(lambda: [swarm.http_url, *swarm.listen_addrs()], peer)

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
            if bare in known.connected or bare in known.announced:
                return ""
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

