"""What an offline W&B run holds, read from its ``run-<id>.wandb`` file (wandb ships no reader of its own).

The file is LevelDB's log format under a 7-byte header (``:W&B``, a magic number, a version): 32 KiB
blocks of chunks, each with a 7-byte header (crc32c, length, type: 1 a whole record, 2/3/4 its first,
middle and last pieces; a block's tail shorter than a header is padding). Each record is a
``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


@dataclass
class OfflineRun:
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config, by key (each value decoded from its JSON)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per history row, with ``_step``."""
    summary: dict[str, Any] = field(default_factory=dict)
    """The last summary update of each key."""
    name: str = ""
    exited: bool = False
    """Whether the file holds the run's exit record (``run.finish()``). wandb-core writes the file out
    after ``finish`` returns, when the stream closes: a reader waits for this."""


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, piece, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if pos + HEADER + length > len(data):  # being written: the rest comes later
            break
        piece += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # a whole record, or its last piece
            out.append(piece)
            piece = b""
    return out


def _key(item: Any) -> str:
    return str(item.key) or "/".join(item.nested_key)


def read_offline_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    for raw in _records(path):
        rec = pb.Record()  # type: ignore[attr-defined]  # protobuf's generated module declares no names
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.name = rec.run.display_name or run.name  # a later run record may update other fields
            run.config.update({_key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "exit":
            run.exited = True
    return run
