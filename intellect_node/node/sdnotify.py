"""The systemd notification protocol (``sd_notify``), spoken directly: no new dependency.

With ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a unix datagram socket path; a leading ``@``
means the abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). A
service sends newline-separated ``KEY=VALUE`` lines in one datagram: ``READY=1`` once up,
``WATCHDOG=1`` at least every ``WATCHDOG_USEC`` (systemd kills and restarts it otherwise),
``STOPPING=1`` when it begins to stop, ``STATUS=...`` for ``systemctl status``.

Without ``NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``) every method is a no-op. A failed send
is logged at DEBUG and otherwise ignored: the node must never stop because its supervisor went away.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """``Notifier()`` reads the environment once; see the module docstring."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_s: float | None = None
        """The watchdog timeout systemd set for this process (None: no watchdog)."""
        try:
            usec = int(env.get("WATCHDOG_USEC", "0"))
            pid = int(env.get("WATCHDOG_PID", "0") or "0")
        except ValueError:
            usec, pid = 0, 0
        if usec > 0 and pid in (0, os.getpid()):
            self.watchdog_s = usec / 1e6

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> bool:
        """Send ``lines`` as one notification; True if it went out."""
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall("\n".join(lines).encode())
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", lines, exc)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text[:200]}")
