"""Atomic file writes: write to a temporary file in the same directory, fsync, rename, fsync the dir.

A reader never sees a half-written file, and after a crash either the old or the new content is there.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
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


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The JSON objects of an append-only JSONL log (``metrics.jsonl``, ``hops.jsonl``), oldest first;
    ``[]`` when there is no file. A line that does not parse as an object is skipped: appends are not
    atomic, so a process killed mid-write leaves a torn last line, which must not hide the rest."""
    import json

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
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
