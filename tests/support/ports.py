"""A TCP port on 127.0.0.1 that nothing listens on now: the kernel's pick, released at once.

For tests that must name a port before its listener starts (a bootstrap address known in advance, a dead
address to dial). Another process could take it in between; every user binds it moments later.
"""

from __future__ import annotations

from intellect_node.p2p.ports import free_tcp_port


def free_port() -> int:
    return free_tcp_port()
