"""Atomic file writes: write to a temporary file in the same directory, fsync, rename, fsync the dir.

A reader never sees a half-written file, and after a crash either the old or the new content is there.
"""

from __future__ import annotations

import os
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
