"""Each rollout is counted once: rollout keys, the per-version memory of them, and its journal.

A rollout's identity is (run, policy version, worker, problem, sample index) (the index is the k-th
occurrence of the problem in its batch, as ``proofs.sampling.batch_seeds`` numbers them), and, on the
side, its rollout ID. The same records under another blob name, in another batch or mixed with new ones
are the same rollouts: validators and the trainer refuse them (``duplicate``) whatever the batch CID.

Memory is bounded by version: a rollout older than ``async_level`` versions is refused as stale before
its keys are looked at, so the keys of such versions can go (:meth:`SeenRollouts.forget_below`).

The trainer's memory must outlive a SIGKILL: :class:`AdmittedJournal` appends each admitted batch's keys
(one JSON line, fsynced) right after the batch is persisted in the inbox and before it is queued, and is
rewritten atomically without the old versions as the trainer moves on. A torn last line (a kill mid-write)
is ignored: its batch is still in the inbox, whose keys the trainer adds back on restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Generic, Hashable, Iterable, Sequence, TypeVar

from intellect_node.config.status import clean_text
from intellect_node.fsutil import atomic_write_text
from intellect_node.protocol.rollout import RolloutRecord

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def rollout_keys(records: Sequence[RolloutRecord]) -> list[str]:
    """Two keys per record, both scoped to its worker: (run, worker, problem, sample index) and the
    rollout ID. The policy version is the caller's outer key."""
    index: dict[str, int] = {}
    out = []
    for r in records:
        k = index.get(r.problem_id, 0)
        index[r.problem_id] = k + 1
        out.append(f"s\0{r.run_id}\0{r.worker}\0{r.problem_id}\0{k}")
        out.append(f"i\0{r.worker}\0{r.rollout_id}")
    return out


def describe_key(key: str) -> str:
    """A key as a reader wants it in a refusal's detail (its IDs are the worker's: cleaned and cut)."""
    parts = key.split("\0")
    if parts[0] == "s" and len(parts) == 5:
        return f"sample {parts[4]} of {clean_text(parts[3], 80)}"
    if parts[0] == "i" and len(parts) == 3:
        return f"rollout ID {clean_text(parts[2], 80)}"
    return clean_text(repr(key), 120)


class SeenRollouts:
    """Rollout keys counted so far, per policy version."""

    def __init__(self) -> None:
        self._by_version: dict[int, set[str]] = {}

    def first_seen(self, version: int, keys: Iterable[str]) -> str | None:
        """The first of ``keys`` already counted at ``version``, or None."""
        have = self._by_version.get(version)
        if not have:
            return None
        return next((k for k in keys if k in have), None)

    def add(self, version: int, keys: Iterable[str]) -> None:
        self._by_version.setdefault(version, set()).update(keys)

    def discard(self, version: int, keys: Iterable[str]) -> None:
        have = self._by_version.get(version)
        if have is not None:
            have.difference_update(keys)
            if not have:
                del self._by_version[version]

    def forget_below(self, floor: int) -> list[int]:
        """Drop the keys of versions below ``floor``; returns the versions dropped."""
        gone = [v for v in self._by_version if v < floor]
        for v in gone:
            del self._by_version[v]
        return gone

    def versions(self) -> list[int]:
        return sorted(self._by_version)

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_version.values())


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
    def _line(version: int, worker: str, cid: str, keys: Sequence[str]) -> str:
        return json.dumps({"v": version, "w": worker, "cid": cid, "k": list(keys)}, separators=(",", ":"))

    def _write(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            # A kill mid-write leaves a torn line; start ours on a fresh one so it stays readable.
            os.write(fd, ("\n" + line + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)

    def append_now(self, version: int, worker: str, cid: str, keys: Sequence[str]) -> None:
        """:meth:`append` for a caller that may block (start-up, before the event loop serves anyone)."""
        line = self._line(version, worker, cid, keys)
        self.add(version, keys)
        self._lines.setdefault(version, []).append(line)
        self._write(line)

    async def append(self, version: int, worker: str, cid: str, keys: Sequence[str]) -> None:
        """Persist an admitted batch's keys (one fsynced line) and count them."""
        line = self._line(version, worker, cid, keys)
        async with self._io:
            self.add(version, keys)
            self._lines.setdefault(version, []).append(line)
            await asyncio.to_thread(self._write, line)

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


class BoundedMap(Generic[K, V]):
    """A dict that forgets its oldest entries past ``limit`` (what a peer can make us remember must be
    bounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._d: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        return self._d.get(key)

    def put(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def items(self) -> list[tuple[K, V]]:
        return list(self._d.items())
