"""Logging for the CLI: JSON lines (one object per record) for daemons, short human lines otherwise.

Library modules only ``logging.getLogger(__name__)``; this module, called once by a command, installs the
handlers. Each JSON line has ``ts`` (UNIX seconds), ``level``, ``logger``, ``msg``, and, when present,
``exc`` and any ``extra={...}`` fields a caller attached (only JSON-able values; others become strings).

py-libp2p logs about 60 harmless WARNINGs per short run (docs/libp2p.md, "Host"); its
loggers are held at ERROR unless ``--log-level DEBUG``. Even its ERRORs are mostly noise to an operator: a
peer that leaves gives a burst of ``Failed to open TCP stream: all attempts to connect to H:P failed`` (48
lines in two minutes, one per dial retry), which pushed real warnings out of the dashboard's panel. So the
``libp2p`` logger does not propagate; its records pass :class:`LibraryNoiseGate`, which says once per
peer per :data:`NOISE_INTERVAL_S` what they mean ("peer at H:P unreachable", at INFO) and lets through
other library ERRORs at most once per message per interval, with a count of those held back.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from intellect_node.errors import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NOISY = ("libp2p", "multiaddr", "aioquic", "zeroconf", "async_service", "urllib3", "filelock")
NOISE_INTERVAL_S = 300.0
"""How often one peer's dial failures, or one library message, may reach the log (seconds)."""
_UNREACHABLE = re.compile(r"(?:Failed to open TCP stream|Unexpected error opening TCP stream).*?"
                          r"(?:connect to |connecting to \(')(\[?[\w.:]+?\]?)(?:', |:)(\d+)")
_HANDSHAKE = re.compile(r"failed to upgrade (?:security|mux) for peer (\w+)")
_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {"ts": round(record.created, 6), "level": record.levelname,
                                  "logger": record.name, "msg": record.getMessage()}
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                plain = isinstance(value, (str, int, float, bool, type(None), list, dict))
                doc[key] = value if plain else str(value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        self.converter = time.localtime


class LibraryNoiseGate(logging.Handler):
    """The only handler of the ``libp2p`` logger (which does not propagate): passes on to the root logger's
    handlers what an operator can act on, in their words, rate-limited.

    - a dial that failed at the TCP level -> ``peer at H:P unreachable`` (INFO, logger ``intellect_node.p2p``)
      once per address per interval: the peer left or its host is down; the swarm already retries;
    - a failed security/muxer upgrade -> ``peer X: connection handshake failed`` (INFO), likewise;
    - any other record: passed unchanged, at most once per (logger, message template) per interval; the
      next one passed says how many were held back.
    At ``--log-level DEBUG`` every record passes unchanged (``passthrough``)."""

    def __init__(self, *, interval: float = NOISE_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 passthrough: bool = False) -> None:
        super().__init__(logging.DEBUG)
        self.interval = interval
        self.clock = clock
        self.passthrough = passthrough
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def _due(self, key: tuple[str, str]) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        if len(self._last) > 10_000:  # a hostile swarm of addresses must not grow this without bound
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return True

    def translate(self, record: logging.LogRecord) -> logging.LogRecord | None:
        """The record to pass on for ``record``, or None to hold it back."""
        if self.passthrough:
            return record
        text = record.getMessage()
        m = _UNREACHABLE.search(text)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            return self._said(("unreachable", where), record,
                              f"peer at {where} unreachable (left, or its host is down; libp2p retries it)",
                              where=where)
        m = _HANDSHAKE.search(text)
        if m:
            return self._said(("handshake", m.group(1)), record, f"peer {m.group(1)}: connection handshake "
                              "failed (it went away mid-dial, or speaks another protocol)", peer=m.group(1))
        key = (record.name, str(record.msg))
        if not self._due(key):
            return None
        held = self._held.pop(key, 0)
        if held:
            record.held_back = held
        return record

    def _said(self, key: tuple[str, str], original: logging.LogRecord, msg: str,
              **fields: str) -> logging.LogRecord | None:
        if not self._due(key):
            return None
        held = self._held.pop(key, 0)
        record = logging.LogRecord("intellect_node.p2p", logging.INFO, original.pathname, original.lineno,
                                   msg + (f" ({held} more since)" if held else ""), None, None)
        record.created = original.created
        record.library = original.getMessage()[:300]  # the library's own words, for whoever digs deeper
        for k, v in fields.items():
            setattr(record, k, v)
        return record

    def emit(self, record: logging.LogRecord) -> None:
        out = self.translate(record)
        if out is not None:
            logging.getLogger().handle(out)


def quiet_library(*, debug: bool = False, gate: LibraryNoiseGate | None = None) -> LibraryNoiseGate:
    """Route the ``libp2p`` logger through one :class:`LibraryNoiseGate` (replacing an earlier one).

    py-libp2p's import clears that logger's handlers, and it is often imported later (a node starts
    libp2p after logging is set up), so the gate is also left on the logger as ``intellect_node_gate``,
    where ``p2p.swarm.quiet_libp2p_logging`` puts it back after the import."""
    lib = logging.getLogger("libp2p")
    for old in [h for h in lib.handlers if isinstance(h, LibraryNoiseGate)]:
        lib.removeHandler(old)
    gate = gate or LibraryNoiseGate(passthrough=debug)
    lib.intellect_node_gate = gate  # type: ignore[attr-defined]  # our attribute on logging's Logger
    lib.addHandler(gate)
    lib.propagate = False
    return gate


def setup_logging(*, level: str = "INFO", json_lines: bool = True, file: Path | None = None,
                  stream: IO[str] | None = None) -> logging.Handler:
    """Install one handler on the root logger (replacing earlier ones from this function) and return it."""
    level = level.upper()
    if level not in LEVELS:
        raise ConfigError(f"--log-level {level!r}: expected one of {', '.join(LEVELS)}", field="log_level")
    if file is not None:
        try:
            file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # often the data dir itself
            from intellect_node.fsutil import ensure_private_file

            ensure_private_file(file)  # 0600: logs name peers, addresses and the data dir
            handler: logging.Handler = logging.FileHandler(file, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--log-file {file}: cannot open ({exc.strerror}); pick a writable path",
                              field="log_file") from exc
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLinesFormatter() if json_lines else PlainFormatter())
    handler._intellect_node = True  # type: ignore[attr-defined]  # our mark on logging's Handler
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_intellect_node", False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.ERROR)
    quiet_library(debug=level == "DEBUG")
    logging.captureWarnings(True)
    return handler
