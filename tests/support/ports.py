"""A TCP port on 127.0.0.1 that nothing listens on now: the kernel's pick, released at once.

For tests that must name a port before its listener starts (a bootstrap address known in advance, a dead
address to dial). Another process could take it in between; every user binds it moments later.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
