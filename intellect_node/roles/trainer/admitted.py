"""The trainer's memory of admitted rollouts (``common/seen.py``), journaled so it outlives a SIGKILL.

:class:`AdmittedJournal` appends each admitted batch's keys (one JSON line, fsynced) right after the batch
is persisted in the inbox and before it is queued, and is rewritten atomically without the old versions as
the trainer moves on. A torn last line (a kill mid-write) is ignored: its batch is still in the inbox,
whose keys the trainer adds back on restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Sequence

from intellect_node.fsutil import append_jsonl, atomic_write_text
from intellect_node.roles.common.seen import SeenRollouts

log = logging.getLogger(__name__)

SEPARATORS = (",", ":")


class AdmittedJournal(SeenRollouts):
    """The trainer's :class:`SeenRollouts`, persisted in ``path`` (JSON lines, see the module doc).

    Memory changes happen on the caller's thread (the event loop): check with :meth:`first_seen` and
    reserve with :meth:`add` before any await, so two verdicts cannot both pass. File writes run in a
    thread, one at a time (an append racing a compaction's rename would lose the appended line)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._lines: dict[int, list[str]] = {}
        self._io = asyncio.Lock()
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8", errors="replace").split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                version, keys = int(doc["v"]), [str(k) for k in doc["k"]]
            except (ValueError, KeyError, TypeError) as exc:
                last = all(not x.strip() for x in lines[i + 1:])
                # A torn last line is a kill mid-append (its batch is still in the inbox); anything else
                # is damage we can only report.
                (log.info if last else log.warning)("admitted-rollouts journal line %d unreadable (%s); "
                                                    "skipped", i + 1, exc)
                continue
            self.add(version, keys)
            self._lines.setdefault(version, []).append(line)

    @staticmethod
    def _record(version: int, worker: str, cid: str, keys: Sequence[str]) -> tuple[dict[str, object], str]:
        """The journal's record of a batch, and its line as written."""
        record = {"v": version, "w": worker, "cid": cid, "k": list(keys)}
        return record, json.dumps(record, separators=SEPARATORS)

    def _write(self, record: dict[str, object]) -> None:
        # A kill mid-write leaves a torn line; start ours on a fresh one so it stays readable.
        append_jsonl(self.path, record, mode=0o600, fresh_line=True, separators=SEPARATORS)

    def append_now(self, version: int, worker: str, cid: str, keys: Sequence[str]) -> None:
        """:meth:`append` for a caller that may block (start-up, before the event loop serves anyone)."""
        record, line = self._record(version, worker, cid, keys)
        self.add(version, keys)
        self._lines.setdefault(version, []).append(line)
        self._write(record)

    async def append(self, version: int, worker: str, cid: str, keys: Sequence[str]) -> None:
        """Persist an admitted batch's keys (one fsynced line) and count them."""
        record, line = self._record(version, worker, cid, keys)
        async with self._io:
            self.add(version, keys)
            self._lines.setdefault(version, []).append(line)
            await asyncio.to_thread(self._write, record)

    def holds(self, version: int, keys: Sequence[str]) -> bool:
        have = self._by_version.get(version, set())
        return all(k in have for k in keys)

    async def compact(self, floor: int) -> int:
        """Forget versions below ``floor`` and rewrite the file without them; returns versions dropped."""
        async with self._io:
            gone = self.forget_below(floor)
            for v in gone:
                self._lines.pop(v, None)
            if gone:
                text = "".join(line + "\n" for v in sorted(self._lines) for line in self._lines[v])
                await asyncio.to_thread(atomic_write_text, self.path, text, 0o600)
            return len(gone)
