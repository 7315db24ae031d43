"""Atomic file writes: write to a temporary file in the same directory, fsync, rename, fsync the dir.

A reader never sees a half-written file, and after a crash either the old or the new content is there.
Append-only JSON-lines files (journals, metrics) are written by one helper, :class:`JsonlAppender`
(:func:`append_jsonl` for a single append): each append is fsynced before it returns.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TypedDict, Unpack


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | memoryview, mode: int = 0o644) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_replace_file(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Move a fully written file ``src`` over ``dst`` durably (both in the same filesystem)."""
    with open(src, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


class JsonDumps(TypedDict, total=False):
    """The ``json.dumps`` options a JSON-lines file is written with (the compact form, a key order)."""

    separators: tuple[str, str]
    sort_keys: bool
    ensure_ascii: bool


class JsonlAppender:
    """An append-only JSON-lines file: each :meth:`append` writes its records (``json.dumps(record,
    **dumps)``, one a line) with ``O_APPEND`` and fsyncs the file before it returns; the file is created
    with ``mode`` (less the umask) and, when this appender created it, its directory is fsynced too, so
    the file itself survives a crash. The file stays open until :meth:`close`.

    ``fresh_line``: every append starts with a newline, so a line torn by a kill mid-write ends there and
    the next append's line stays readable (the reader skips the blank lines).

    For diagnostics (timestamps no one acts on): ``fsync=False`` leaves the flushing to the kernel, and
    ``max_bytes`` rotates the file to ``<name>.1`` (one old file kept) once an append finds it past that
    size, so a long-running node's log stays bounded."""

    def __init__(self, path: str | os.PathLike[str], *, mode: int = 0o666, fresh_line: bool = False,
                 fsync: bool = True, max_bytes: int | None = None, **dumps: Unpack[JsonDumps]) -> None:
        self.path = Path(path)
        self.mode = mode
        self.fresh_line = fresh_line
        self.fsync = fsync
        self.max_bytes = max_bytes
        self.dumps = dumps
        self._fd: int | None = None
        self._size = 0

    def append(self, records: Iterable[object]) -> None:
        text = "".join(json.dumps(r, **self.dumps) + "\n" for r in records)
        if not text:
            return
        if self._fd is None:
            self._open()
        if self.max_bytes is not None and self._size > self.max_bytes:
            self.close()
            self.path.replace(self.path.with_name(self.path.name + ".1"))
            self._open()
        assert self._fd is not None
        data = memoryview((("\n" if self.fresh_line else "") + text).encode("utf-8"))
        self._size += len(data)
        while data:
            data = data[os.write(self._fd, data):]
        if self.fsync:
            os.fsync(self._fd)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.mode)
        self._size = os.fstat(self._fd).st_size
        if created and self.fsync:
            fsync_dir(self.path.parent)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def append_jsonl(path: str | os.PathLike[str], *records: object, mode: int = 0o666, fresh_line: bool = False,
                 fsync: bool = True, max_bytes: int | None = None, **dumps: Unpack[JsonDumps]) -> None:
    """Append ``records`` to the JSON-lines file ``path``, fsynced unless ``fsync=False``, rotated past
    ``max_bytes`` (:class:`JsonlAppender`, opened for this one append)."""
    appender = JsonlAppender(path, mode=mode, fresh_line=fresh_line, fsync=fsync, max_bytes=max_bytes,
                             **dumps)
    try:
        appender.append(records)
    finally:
        appender.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The JSON objects of an append-only JSONL log (``metrics.jsonl``, ``hops.jsonl``), oldest first;
    ``[]`` when there is no file. A line that does not parse as an object is skipped: appends are not
    atomic, so a process killed mid-write leaves a torn last line, which must not hide the rest."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return json_objects(text.splitlines())


def json_objects(lines: Iterable[str]) -> list[dict[str, object]]:
    """The lines that are one JSON object each, in order (any other line is left out)."""
    out = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


PRIVATE_FILE_MODE = 0o600
"""Files that name peers, addresses or secrets: the ledger, logs, the control file, the node key."""


def ensure_private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if missing, or tighten it to 0600 if others can read it.

    Called before a library (sqlite3, logging) opens the file, so it never exists with the umask's
    looser bits. Only regular files are touched (``--log-file /dev/stderr`` stays as it is).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE))
        return
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode) and mode & 0o077:
        os.chmod(path, mode & ~0o077)
