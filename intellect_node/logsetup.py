"""Logging for the CLI: JSON lines (one object per record) for daemons, short human lines otherwise.

Library modules only ``logging.getLogger(__name__)``; this module, called once by a command, installs the
handlers. Each JSON line has ``ts`` (UNIX seconds), ``level``, ``logger``, ``msg``, and, when present,
``exc`` and any ``extra={...}`` fields a caller attached (only JSON-able values; others become strings).

py-libp2p logs about 60 harmless WARNINGs per short run (see /work/shared/notes/libp2p-0.8.1.md); its
loggers are held at ERROR unless ``--log-level DEBUG``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import IO, Any

from intellect_node.errors import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NOISY = ("libp2p", "multiaddr", "aioquic", "zeroconf", "async_service", "urllib3", "filelock")
_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname,
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


def setup_logging(*, level: str = "INFO", json_lines: bool = True, file: Path | None = None,
                  stream: IO[str] | None = None) -> logging.Handler:
    """Install one handler on the root logger (replacing earlier ones from this function) and return it."""
    level = level.upper()
    if level not in LEVELS:
        raise ConfigError(f"--log-level {level!r}: expected one of {', '.join(LEVELS)}", field="log_level")
    if file is not None:
        try:
            file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # often the data dir itself
            from intellect_node.p2p.identity import ensure_private_file

            ensure_private_file(file)  # 0600: logs name peers, addresses and the data dir
            handler: logging.Handler = logging.FileHandler(file, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--log-file {file}: cannot open ({exc.strerror}); pick a writable path",
                              field="log_file") from exc
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLinesFormatter() if json_lines else PlainFormatter())
    handler._intellect_node = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_intellect_node", False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.ERROR)
    logging.captureWarnings(True)
    return handler
