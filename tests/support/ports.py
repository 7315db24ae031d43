"""TCP ports on 127.0.0.1 that nothing listens on now, for tests that name a port before its listener starts.

:func:`free_port` is the kernel's pick, released at once: fine for a dead address to dial or a listener
started at once. Another process could take it in between: the kernel hands the same range out for every
port-0 bind and every outgoing connection's source port, which on a machine busy with other swarms
happens within seconds. :func:`reserved_port` picks below that range (``ip_local_port_range``), where
only a process binding that very port by name could take it: for a listener whose address others dial
while it is still starting.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from intellect_node.p2p.ports import free_tcp_port

LOWEST = 10000
"""The lowest port :func:`reserved_port` picks (well above the registered services tests might meet)."""


def free_port() -> int:
    return free_tcp_port()


def _ephemeral_low() -> int:
    """The start of the kernel's ephemeral port range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def reserved_port(tries: int = 100) -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range (random, bind-checked)."""
    high = _ephemeral_low()
    for _ in range(tries):
        port = random.randrange(LOWEST, max(high, LOWEST + 1000))
        with socket.socket(socket.AF_INET) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in [{LOWEST}, {high}) after {tries} tries")
