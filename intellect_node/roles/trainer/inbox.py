"""The trainer's memory of admitted work, which outlives a SIGKILL: the inbox and the admitted-keys journal.

Admitting a batch its validators accepted (:meth:`Inbox.admit`) takes three steps before the trainer
queues it: its rollout keys are checked against those admitted before and reserved, with no await in
between (two verdicts cannot both pass with the same rollouts; ``roles/common/seen.py``); the batch bytes
and a small JSON (worker, version, arrival order, the sealed acceptances that admitted it) are written to
``trainer/inbox/<cid>.batch|.json`` atomically; its keys are appended to ``trainer/admitted.jsonl``
(fsynced). A crash from the inbox write on re-queues the batch on restart (:meth:`Inbox.reload`), adding
its keys back should the journal line not have made it. Once a checkpoint lists a batch as consumed, its
inbox files go (:meth:`Inbox.drop`).

The trainer checkpoints only every ``rl.checkpoint_every`` steps, so the inbox also holds the batches of
the steps since the last checkpoint, and :class:`StepJournal` (``trainer/steps.jsonl``) says which batches
each of those steps took, in which order. A restarted trainer loads the checkpoint and replays those
entries against the inbox: on the CPU the same weights, optimizer state and samples in the same order give
bit-identical weights, so the versions it announced before the crash come out again unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from intellect_node.errors import IntellectNodeError
from intellect_node.fsutil import append_jsonl, atomic_write_bytes, atomic_write_text
from intellect_node.protocol.rollout import RolloutBatch, decode_batch
from intellect_node.protocol.steps import DroppedBatch
from intellect_node.roles.common.rescore import RefusedBatch
from intellect_node.roles.common.seen import describe_key, rollout_keys
from intellect_node.roles.trainer.admitted import AdmittedJournal
from intellect_node.roles.trainer.batching import Accepted

if TYPE_CHECKING:
    from intellect_node.trainer.step import Sample

log = logging.getLogger(__name__)

GroupsOf = Callable[[RolloutBatch, str, int], "list[list[Sample]]"]
"""The trainer's check of a batch against its (worker, version), returning its groups of samples;
raises an IntellectNodeError for a batch that does not match."""


class DuplicateRollouts(RefusedBatch):
    """An accepted batch holds rollouts the trainer already admitted."""

    reason = "duplicate"


class Inbox:
    """``directory`` holds the batches admitted and not yet consumed; ``journal`` their rollout keys."""

    def __init__(self, directory: Path, journal: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.admitted = AdmittedJournal(journal)
        self.seq = 0
        """The newest arrival number handed out (batches are queued in this order after a restart)."""

    async def admit(self, cid: str, worker: str, version: int, data: bytes, keys: Sequence[str],
                    evidence: Sequence[bytes] = ()) -> int:
        """Reserve ``keys`` and persist the batch with its ``evidence`` (the sealed acceptances); its arrival
        number. Raises :class:`DuplicateRollouts` when one of the keys was admitted before at ``version``."""
        dup = self.admitted.first_seen(version, keys)
        if dup is not None:
            raise DuplicateRollouts(f"{describe_key(dup)} at v{version} was admitted before")
        self.admitted.add(version, keys)
        try:
            self.seq += 1
            seq = self.seq
            await asyncio.to_thread(atomic_write_bytes, self.dir / f"{cid}.batch", data)
            meta = {"cid": cid, "worker": worker, "version": version, "seq": seq, "time": time.time(),
                    "evidence": [base64.b64encode(e).decode("ascii") for e in evidence]}
            await asyncio.to_thread(atomic_write_text, self.dir / f"{cid}.json", json.dumps(meta))
            await self.admitted.append(version, worker, cid, keys)
        except BaseException:
            self.admitted.discard(version, keys)
            raise
        return seq

    def reload(self, consumed: Container[str], groups_of: GroupsOf) -> list[Accepted]:
        """After a restart (blocking; before the event loop serves anyone): every persisted batch not in
        ``consumed``, in arrival order. Consumed batches' files are removed, unreadable ones skipped."""
        found = []
        for meta_path in self.dir.glob("*.json"):
            try:
                meta = json.loads(meta_path.read_text())
                cid = str(meta["cid"])
                if cid in consumed:
                    self.drop(cid)
                    continue
                batch = decode_batch((self.dir / f"{cid}.batch").read_bytes())
                worker, version, seq = str(meta["worker"]), int(meta["version"]), int(meta["seq"])
                evidence = tuple(base64.b64decode(e, validate=True) for e in meta.get("evidence", []))
                groups = groups_of(batch, worker, version)
            except (OSError, ValueError, KeyError, TypeError, binascii.Error, IntellectNodeError) as exc:
                log.warning("inbox entry %s unreadable (%s); skipped", meta_path.name, exc)
                continue
            keys = rollout_keys(batch.rollouts)
            if not self.admitted.holds(version, keys):  # killed between the inbox write and the journal
                self.admitted.append_now(version, worker, cid, keys)
            found.append(Accepted(cid, worker, version, groups, seq, evidence))
        found.sort(key=lambda a: a.seq)
        self.seq = max([self.seq, *(a.seq for a in found)])
        return found

    def drop(self, cid: str) -> None:
        """A checkpoint holds the batch now: its inbox copy is no longer needed."""
        for suffix in (".json", ".batch"):
            (self.dir / f"{cid}{suffix}").unlink(missing_ok=True)


@dataclass(frozen=True)
class JournalEntry:
    """One step as the trainer took it: at policy ``version``, the batches ``taken`` (in the order their
    groups were trained on), the queued ones refused as ``stale`` on the way, and the accepted batches
    ``dropped`` without queuing that its step record names (so a replayed record is the same)."""

    seq: int
    version: int
    taken: tuple[str, ...]
    stale: tuple[str, ...]
    dropped: tuple[DroppedBatch, ...] = ()

    def line(self) -> dict[str, object]:
        """The journal's JSON line."""
        return {"seq": self.seq, "version": self.version, "taken": list(self.taken),
                "stale": list(self.stale), "dropped": [[d.cid, d.worker, d.reason] for d in self.dropped]}


class StepJournal:
    """``trainer/steps.jsonl``: one fsynced line per step, written *before* the step trains (so every
    version announced has its recipe on disk), trimmed to the entries after a checkpoint once it commits.

    Appends and trims come from the trainer's one training loop, never at once. A torn last line (a
    SIGKILL mid-write) is ignored: that step had not trained yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[JournalEntry] = []
        self._load()
        self.seq = max((e.seq for e in self.entries), default=0)
        """The newest entry's number (0: none since the journal began)."""

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        for line in text.splitlines():
            try:
                d = json.loads(line)
                self.entries.append(JournalEntry(
                    int(d["seq"]), int(d["version"]), tuple(str(c) for c in d["taken"]),
                    tuple(str(c) for c in d["stale"]),
                    tuple(DroppedBatch(cid=str(c), worker=str(w), reason=str(r))
                          for c, w, r in d.get("dropped", []))))
            except (ValueError, KeyError, TypeError):
                log.warning("step journal %s: unreadable line skipped (torn by a crash?)", self.path)

    def after(self, seq: int) -> list[JournalEntry]:
        """The steps after the checkpoint that covers entries up to ``seq``, oldest first."""
        return [e for e in self.entries if e.seq > seq]

    def append(self, version: int, taken: Sequence[str], stale: Sequence[str],
               dropped: Sequence[DroppedBatch] = ()) -> JournalEntry:
        """Record the next step (blocking: a small fsynced append; run it in a thread)."""
        entry = JournalEntry(self.seq + 1, version, tuple(taken), tuple(stale), tuple(dropped))
        append_jsonl(self.path, entry.line())
        self.seq = entry.seq
        self.entries.append(entry)
        return entry

    def trim(self, upto: int) -> None:
        """A checkpoint now covers entries up to ``upto``: keep only the later ones (blocking)."""
        self.entries = [e for e in self.entries if e.seq > upto]
        atomic_write_text(self.path, "".join(json.dumps(e.line()) + "\n" for e in self.entries))
