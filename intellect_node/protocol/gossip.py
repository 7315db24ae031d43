"""Swarm-level wire messages: heartbeats (gossip) and node info (``/intellect/info/1.0.0``).

Both travel as :class:`~intellect_node.protocol.signing.Envelope` s with their own domain tag, so a
heartbeat signature cannot be replayed as node info. They carry the sender's HTTP base URL: that is how
a DHT provider (a peer ID) becomes a URL to fetch chunks from. Receivers bound every list and string.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

import msgspec

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.freshness import check_stamp
from intellect_node.protocol.signing import open_envelope
from intellect_node.protocol.topics import validate_run_id

HEARTBEAT_DOMAIN = "intellect/heartbeat/1"
NODE_INFO_DOMAIN = "intellect/node-info/1"

MAX_HEARTBEAT_SIZE = 4096
"""Bytes of one heartbeat payload: a URL, a few addresses, a few role names."""
MAX_NODE_INFO_SIZE = 4096
MAX_ADDRS = 8
MAX_ADDR_LEN = 256
MAX_ROLES = 8
MAX_URL_LEN = 256
MAX_URL_PATH_LEN = 64
"""A base URL's path prefix (a node behind a reverse proxy); the blob routes follow it."""
MAX_CLOCK_SKEW_MS = 5 * 60 * 1000
"""Heartbeats stamped further than this from our clock are ignored (``MessageIgnored``: replays, broken
clocks), blamed on no one."""
MAX_INTERVAL_MS = 24 * 3600 * 1000
"""Largest announced heartbeat interval accepted; receivers cap what they honour far lower
(``network.heartbeat_max_interval``), this only refuses nonsense."""


class Heartbeat(codec.Message, frozen=True):
    """Sent on ``/intellect/<run>/heartbeat/1`` every ``network.heartbeat_interval`` seconds, or less
    often in a large swarm (``p2p/heartbeat.py``).

    ``interval_ms`` is the most the sender waits before its next heartbeat, present only when it is
    longer than the sender's base interval: receivers then time the sender out after a few of *its*
    intervals. It is ``UNSET`` (absent from the bytes, not a zero) otherwise, so a heartbeat of a node
    that does not stretch encodes exactly as before the field existed and nodes of the previous release
    still accept it; a heartbeat without the field (every old node's) parses as unstretched.
    """

    run_id: str
    seq: int  # strictly increasing per sender within one process lifetime
    time_ms: int  # sender's wall clock (unix ms)
    http_url: str  # bulk HTTP base URL, "" if none
    listen_addrs: list[str]  # full multiaddrs ending /p2p/<id>
    roles: list[str] = []
    interval_ms: int | msgspec.UnsetType = msgspec.UNSET


class NodeInfo(codec.Message, frozen=True):
    """The answer of ``/intellect/info/1.0.0``."""

    run_id: str
    time_ms: int
    http_url: str
    listen_addrs: list[str]
    roles: list[str] = []


P2P_URL_PREFIX = "p2p://"
"""A node behind NAT advertises ``p2p://<its own peer ID>``: "fetch my chunks over libp2p" (docs/nat.md)."""

_DNS_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_URL_PATH = re.compile(r"(?:/[A-Za-z0-9._~-]+)*/?")


def validate_http_url(url: str) -> str:
    """Raise ProtocolError unless ``url`` is a plain HTTP(S) base URL a fetcher can use as it is.

    Accepted: scheme ``http`` or ``https``; an ASCII host (a DNS name, an IPv4 address or a bracketed
    IPv6 address); an optional port 1-65535; an optional path prefix of unreserved characters (no
    ``..``, at most :data:`MAX_URL_PATH_LEN`); nothing else: no user info, query, fragment, escapes or
    spaces, at most :data:`MAX_URL_LEN` characters. A URL that passes parses with ``urlsplit`` and
    encodes as ASCII, so a fetcher cannot fail on it in another way than a failed connection."""
    if not url or len(url) > MAX_URL_LEN or not url.isascii() or not url.isprintable() \
            or any(c in url for c in " \\%@?#"):
        raise ProtocolError(f"bad http_url {url[:80]!r}: not a short printable ASCII URL without user "
                            "info, query or fragment")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ProtocolError(f"bad http_url {url[:80]!r}: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise ProtocolError(f"bad http_url {url[:80]!r}: scheme must be http or https")
    if parts.netloc.startswith("["):  # [IPv6]:port
        host, _, port = parts.netloc[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ProtocolError(f"bad http_url {url[:80]!r}: bad IPv6 host") from exc
        if port == ":" or port and not port.startswith(":"):
            raise ProtocolError(f"bad http_url {url[:80]!r}: bad port")
        port = port[1:]
    else:
        host, sep, port = parts.netloc.partition(":")
        if len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in host.split(".")):
            raise ProtocolError(f"bad http_url {url[:80]!r}: bad host")
        if sep and not port:
            raise ProtocolError(f"bad http_url {url[:80]!r}: bad port")
    if port and not (port.isdigit() and len(port) <= 5 and 0 < int(port) <= 65535):
        raise ProtocolError(f"bad http_url {url[:80]!r}: bad port")
    path = parts.path
    if len(path) > MAX_URL_PATH_LEN or not _URL_PATH.fullmatch(path) or ".." in path.split("/"):
        raise ProtocolError(f"bad http_url {url[:80]!r}: bad path prefix")
    return url


def _check_common(run_id: str, http_url: str, listen_addrs: list[str], roles: list[str], signer: str) -> None:
    validate_run_id(run_id)
    # The only non-HTTP URL accepted names the signer itself: a node cannot point fetchers at another.
    if http_url and http_url != f"{P2P_URL_PREFIX}{signer}":
        validate_http_url(http_url)
    if len(listen_addrs) > MAX_ADDRS or any(len(a) > MAX_ADDR_LEN or not a.startswith("/")
                                            for a in listen_addrs):
        raise ProtocolError("bad listen_addrs")
    if len(roles) > MAX_ROLES or any(len(r) > 32 for r in roles):
        raise ProtocolError("bad roles")


def open_heartbeat(data: bytes, *, run_id: str, now_ms: int) -> tuple[Heartbeat, str]:
    """Decode, verify and check a heartbeat for ``run_id``; return it and the signer's peer ID. One
    stamped more than :data:`MAX_CLOCK_SKEW_MS` from ``now_ms`` raises ``MessageIgnored``."""
    hb, signer = open_envelope(data, HEARTBEAT_DOMAIN, Heartbeat, max_size=MAX_HEARTBEAT_SIZE)
    _check_common(hb.run_id, hb.http_url, hb.listen_addrs, hb.roles, signer)
    if hb.run_id != run_id:
        raise ProtocolError(f"heartbeat for run {hb.run_id!r}, this node is in {run_id!r}")
    if hb.seq < 0:
        raise ProtocolError(f"heartbeat seq {hb.seq} out of range")
    if hb.interval_ms is not msgspec.UNSET and not 0 < hb.interval_ms <= MAX_INTERVAL_MS:
        raise ProtocolError(f"heartbeat interval_ms {hb.interval_ms} out of range")
    check_stamp(hb.time_ms, now_ms, max_age_ms=MAX_CLOCK_SKEW_MS, max_ahead_ms=MAX_CLOCK_SKEW_MS,
                what="heartbeat")
    return hb, signer


def open_node_info(data: bytes, *, expected_signer: str) -> NodeInfo:
    """Decode and verify node info that must come from ``expected_signer`` (the stream's remote peer)."""
    info, signer = open_envelope(data, NODE_INFO_DOMAIN, NodeInfo, max_size=MAX_NODE_INFO_SIZE)
    if signer != expected_signer:
        raise ProtocolError(f"node info signed by {signer}, but the stream is from {expected_signer}")
    _check_common(info.run_id, info.http_url, info.listen_addrs, info.roles, signer)
    return info
