"""A test-only launcher: the real ``intellect-node`` CLI, plus two signals with which a test breaks the
node's libp2p from outside (the product has no fault-injection switch).

    python tests/support/liveness.py join --data-dir D --headless --listen /ip4/127.0.0.1/tcp/P ...

- SIGUSR2: a trio task raising in the libp2p thread's root nursery, as the pubsub ``DecodeError`` of
  issue #12 did: the thread ends and the node must restart libp2p.
- SIGUSR1: the same, and then this process takes the node's listen port (a plain socket, without
  ``SO_REUSEPORT``) before the node can listen again, so no restart can succeed: the node must give up
  and exit non-zero. The port is taken synchronously on the event loop, right after the libp2p thread
  released it, so the node's watch cannot win the race.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from typing import Any

from intellect_node.node import runtime as runtime_mod

_held: list[socket.socket] = []


class InjectedFault(RuntimeError):
    pass


def _crash(rt: Any) -> None:
    async def boom() -> None:
        raise InjectedFault("injected by the test")

    rt.swarm.bridge.start_soon(boom)


def _crash_and_take_port(rt: Any) -> None:
    port = int(rt.config.network.listen[0].split("/tcp/")[1].split("/")[0])
    _crash(rt)
    deadline = time.monotonic() + 10.0
    while True:  # blocks the event loop on purpose: the node must not rebind first
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
            _held.append(sock)
            print(f"support_liveness: holding port {port}", file=sys.stderr, flush=True)
            return
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


_start = runtime_mod.NodeRuntime.start


async def _start_with_faults(self: Any) -> None:
    await _start(self)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR2, _crash, self)
    loop.add_signal_handler(signal.SIGUSR1, _crash_and_take_port, self)


runtime_mod.NodeRuntime.start = _start_with_faults  # type: ignore[method-assign]  # patched for this test

if __name__ == "__main__":
    from intellect_node.cli import main

    sys.argv[0] = "intellect-node"
    main()
