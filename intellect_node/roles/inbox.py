"""The trainer's memory of admitted work, which outlives a SIGKILL: the inbox and the admitted-keys journal.

Admitting a batch its validators accepted (:meth:`Inbox.admit`) takes three steps before the trainer
queues it: its rollout keys are checked against those admitted before and reserved, with no await in
between (two verdicts cannot both pass with the same rollouts; ``roles/admission.py``); the batch bytes
and a small JSON (worker, version, arrival order) are written to ``trainer/inbox/<cid>.batch|.json``
atomically; its keys are appended to ``trainer/admitted.jsonl`` (fsynced). A crash from the inbox write
on re-queues the batch on restart (:meth:`Inbox.reload`), adding its keys back should the journal line
not have made it. Once a checkpoint lists a batch as consumed, its inbox files go (:meth:`Inbox.drop`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from intellect_node.errors import IntellectNodeError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes, atomic_write_text
from intellect_node.protocol.rollout import RolloutBatch, decode_batch
from intellect_node.roles.admission import AdmittedJournal, describe_key, rollout_keys
from intellect_node.roles.batching import Accepted

if TYPE_CHECKING:
    from intellect_node.trainer.step import Sample

log = logging.getLogger(__name__)

GroupsOf = Callable[[RolloutBatch, str, int], "list[list[Sample]]"]
"""The trainer's check of a batch against its (worker, version), returning its groups of samples;
raises an IntellectNodeError for a batch that does not match."""


class DuplicateRollouts(ProtocolError):
    """An accepted batch holds rollouts the trainer already admitted."""


class Inbox:
    """``directory`` holds the batches admitted and not yet consumed; ``journal`` their rollout keys."""

    def __init__(self, directory: Path, journal: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.admitted = AdmittedJournal(journal)
        self.seq = 0
        """The newest arrival number handed out (batches are queued in this order after a restart)."""

    async def admit(self, cid: str, worker: str, version: int, data: bytes, keys: Sequence[str]) -> int:
        """Reserve ``keys`` and persist the batch; its arrival number. Raises :class:`DuplicateRollouts`
        when one of the keys was admitted before at ``version``."""
        dup = self.admitted.first_seen(version, keys)
        if dup is not None:
            raise DuplicateRollouts(f"{describe_key(dup)} at v{version} was admitted before")
        self.admitted.add(version, keys)
        try:
            self.seq += 1
            seq = self.seq
            await asyncio.to_thread(atomic_write_bytes, self.dir / f"{cid}.batch", data)
            meta = {"cid": cid, "worker": worker, "version": version, "seq": seq, "time": time.time()}
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
                groups = groups_of(batch, worker, version)
            except (OSError, ValueError, KeyError, TypeError, IntellectNodeError) as exc:
                log.warning("inbox entry %s unreadable (%s); skipped", meta_path.name, exc)
                continue
            keys = rollout_keys(batch.rollouts)
            if not self.admitted.holds(version, keys):  # killed between the inbox write and the journal
                self.admitted.append_now(version, worker, cid, keys)
            found.append(Accepted(cid, worker, version, groups, seq))
        found.sort(key=lambda a: a.seq)
        self.seq = max([self.seq, *(a.seq for a in found)])
        return found

    def drop(self, cid: str) -> None:
        """A checkpoint holds the batch now: its inbox copy is no longer needed."""
        for suffix in (".json", ".batch"):
            (self.dir / f"{cid}{suffix}").unlink(missing_ok=True)
