"""``intellect-node logs [-f] [-n N]``: the node's log file, its last lines, and follow mode.

Where a node logs: ``join`` always keeps ``<data-dir>/node.log`` (JSON lines, rotated at
:data:`LOG_MAX_BYTES` with :data:`LOG_BACKUPS` older files beside it), whether it runs with the
dashboard or headless; a headless node writes the same records to stderr as well (the journal under
systemd). Only ``join --log-file F`` moves the log elsewhere, and then ``logs --file F`` reads it.

The command renders JSON lines as short human lines (``--json`` prints them unchanged); lines that are
not JSON (an older plain log, a traceback a library printed) are shown as they are. Follow mode polls
the file and starts again from the top when the node rotated it (a new inode, or a shorter file), the
way ``tail -F`` does, so a long ``logs -f`` survives rotation.
"""

from __future__ import annotations

import io
import json
import logging
import logging.handlers
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError

NODE_LOG = "node.log"
LOG_MAX_BYTES = 10 * 1024 * 1024
"""One log file's size before rotation: about 40 000 JSON lines, days of a quiet node at INFO."""
LOG_BACKUPS = 3
"""Rotated files kept (``node.log.1`` ... ``node.log.3``): the data dir's logs stay under 40 MiB."""
FOLLOW_POLL_S = 0.25
"""Between looks at the file in ``--follow`` (a log line's latency; no inotify dependency)."""


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating handler whose files are created 0600: logs name peers, addresses and the data dir,
    and the file a rotation opens anew would otherwise take the umask's looser bits."""

    def _open(self) -> io.TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8")


def node_log_handler(data_dir_: Path) -> logging.Handler:
    """The handler of ``<data-dir>/node.log`` (JSON lines, rotated, 0600); the data dir is created 0700."""
    from intellect_node.logsetup import JsonLinesFormatter
    from intellect_node.p2p.identity import ensure_data_dir

    ensure_data_dir(data_dir_)
    handler = PrivateRotatingFileHandler(data_dir_ / NODE_LOG, maxBytes=LOG_MAX_BYTES,
                                         backupCount=LOG_BACKUPS, encoding="utf-8")
    handler.setFormatter(JsonLinesFormatter())
    return handler


def render(line: str) -> str:
    """One log line for a person: ``HH:MM:SS LEVEL logger: msg`` (+ the traceback) for a JSON line."""
    try:
        doc = json.loads(line)
    except ValueError:
        return line
    if not isinstance(doc, dict) or "msg" not in doc:
        return line
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc.get("ts", 0))))
    except (TypeError, ValueError, OverflowError):
        stamp = "?"
    out = f"{stamp} {str(doc.get('level', '?')):<7} {doc.get('logger', '?')}: {doc['msg']}"
    if doc.get("exc"):
        out += "\n" + str(doc["exc"])
    return out


def last_lines(path: Path, n: int) -> tuple[list[str], tuple[int, int]]:
    """The last ``n`` lines of ``path`` and where they ended (inode, offset), which ``follow`` starts
    from: a line written in between is neither lost nor printed twice. Reads the file once (a node log
    is at most :data:`LOG_MAX_BYTES`)."""
    with open(path, "rb") as f:
        tail = deque(f, maxlen=n) if n > 0 else deque()
        end = (os.fstat(f.fileno()).st_ino, f.tell())
    return [ln.decode("utf-8", "replace").rstrip("\n") for ln in tail], end


def follow(path: Path, emit: Callable[[str], object], start: tuple[int, int] | None = None) -> None:
    """Print lines appended to ``path`` until interrupted, from ``start`` (inode, offset) when that is
    still the file, re-opening it from its first line after a rotation. Bytes, not text, so offsets
    stay exact; a line is emitted only once its newline arrived."""
    f: BinaryIO | None = None
    inode = 0
    partial = b""
    while True:
        if f is None:
            try:
                f = open(path, "rb")
            except FileNotFoundError:  # between a rotation's rename and the new file
                time.sleep(FOLLOW_POLL_S)
                continue
            inode = os.fstat(f.fileno()).st_ino
            if start is not None and start[0] == inode:
                f.seek(start[1])
            start = None
            partial = b""
        chunk = f.read()
        if chunk:
            partial += chunk
            *complete, partial = partial.split(b"\n")
            for ln in complete:
                emit(ln.decode("utf-8", "replace"))
            continue
        try:
            st = path.stat()
            rotated = st.st_ino != inode or st.st_size < f.tell()
        except FileNotFoundError:
            rotated = True
        if rotated:
            rest = partial + f.read()  # what the node wrote to the old file just before renaming it
            f.close()
            f = None
            for ln in rest.split(b"\n"):
                if ln:
                    emit(ln.decode("utf-8", "replace"))
            continue
        time.sleep(FOLLOW_POLL_S)


def register(app: typer.Typer) -> None:
    @app.command("logs")
    def logs(
        data_dir_opt: Optional[Path] = DataDirOption,
        follow_: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines (Ctrl-C ends)."),
        lines: int = typer.Option(50, "--lines", "-n", min=0, help="How many of the last lines to print."),
        file: Optional[Path] = typer.Option(None, "--file",
                                            help="A log written with `join --log-file F` (default: "
                                                 "<data-dir>/node.log)."),
        as_json: bool = typer.Option(False, "--json", help="Print the JSON lines unchanged."),
    ) -> None:
        """Show the node's log (<data-dir>/node.log): the last -n lines, then new ones with -f."""
        path = file.expanduser() if file is not None else data_dir(data_dir_opt) / NODE_LOG
        if not path.is_file():
            raise ConfigError(f"no log at {path}: a node started with `intellect-node join` writes one "
                              "there; one started with --log-file F logs to F (use --file F); under "
                              "systemd also see `journalctl -u intellect-node`", field="data_dir")

        def emit(line: str) -> None:
            typer.echo(line if as_json else render(line))
            sys.stdout.flush()  # `logs -f | grep`: a line as soon as the node wrote it

        tail, end = last_lines(path, lines)
        for line in tail:
            emit(line)
        if follow_:
            try:
                follow(path, emit, end)
            except KeyboardInterrupt:
                raise typer.Exit(0) from None
