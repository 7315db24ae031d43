"""Refuse a listen port that another process already listens on, before the libp2p host starts.

Why a check of our own: py-libp2p 0.8.1's TCP listener (``libp2p/transport/tcp/tcp.py``,
``_open_reuseport_listeners``) sets ``SO_REUSEPORT`` on every listen socket, so that DCUtR hole punching
can dial out from the listen port (its QUIC listener does the same). On Linux that lets a second process
of the same user bind and listen on the very same address, and the kernel then hands each incoming
connection to one of the two at random: two nodes "both listening" on 127.0.0.1:4001, each reached by
about half the dials meant for the other. Dropping the option from the listener would break hole
punching, so instead :func:`check_listen_ports` binds each fixed listen port once more *without*
``SO_REUSEPORT``, which the kernel refuses while any other socket listens there. ``SO_REUSEADDR`` is set
on the probe, so the TIME_WAIT connections a node leaves behind when it is killed do not stop its
restart on the same port.

Shortcuts: the probe and the host's own bind are two steps, so two nodes started within the same few
milliseconds on one port can both pass; a node started alone (the case that happens: a second ``join``
or a forgotten one) is always caught. Port 0 is not checked (the kernel picks a free port), nor are
addresses that are not ``/ip4|ip6/<addr>/tcp|udp/<port>`` (DNS names, relay circuits): the host reports
those itself.

Evidence and test: ``tests/node/test_files_ports.py`` starts two py-libp2p hosts on one port (both listen)
and shows the check refusing it. When it can go: once py-libp2p refuses a taken port itself (SO_REUSEPORT
only on the hole-punching dial sockets, or a check like this one in its listener); the test's second
``Swarm.start`` then fails, which is the signal.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable

from intellect_node.errors import ConfigError


def fixed_ports(listen: Iterable[str]) -> list[tuple[str, str, int, str]]:
    """``(ip, transport, port, addr)`` of every listen multiaddr with a fixed IP port (not 0)."""
    out = []
    for addr in listen:
        parts = addr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] not in ("tcp", "udp"):
            continue
        try:
            ipaddress.ip_address(parts[1])
            port = int(parts[3])
        except ValueError:
            continue  # not ours to judge: the host's parser names the bad part
        if 0 < port < 65536:
            out.append((parts[1], parts[2], port, addr))
    return out


def free_tcp_port(ip: str = "127.0.0.1") -> int:
    """A TCP port on ``ip`` that nothing listens on now: the kernel's pick, released at once. For a
    listener whose address others must know before it starts; another process could take the port in
    between, which the listener's own :func:`check_listen_ports` then refuses (ConfigError, exit 2)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def port_holder_error(ip: str, transport: str, port: int) -> OSError | None:
    """The OSError a bind of ``ip``:``port`` without ``SO_REUSEPORT`` raises now, or None if it is free."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    kind = socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM
    with socket.socket(family, kind) as sock:
        if kind == socket.SOCK_STREAM:
            # TIME_WAIT leftovers of a killed node must not block its restart. Not for UDP: there the
            # option would let the probe share a port another socket bound with it (no TIME_WAIT in UDP).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError as exc:
            return exc
    return None


def check_listen_ports(listen: Iterable[str]) -> None:
    """ConfigError naming ``--listen`` for the first fixed listen port this node cannot have to itself."""
    for ip, transport, port, addr in fixed_ports(listen):
        exc = port_holder_error(ip, transport, port)
        if exc is None:
            continue
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--listen {addr}: {transport} port {port} is already in use by another process (is another "
                f"node running? `ss -ltnup | grep :{port}` shows who); stop it, or pick a free port with "
                f"--listen /{'ip6' if ':' in ip else 'ip4'}/{ip}/{transport}/<port> (network.listen), or "
                "port 0 for any free port", field="listen") from exc
        raise ConfigError(f"--listen {addr}: cannot bind {ip}:{port} ({exc.strerror}); use an address of "
                          "this machine and a port you may bind (network.listen)", field="listen") from exc
