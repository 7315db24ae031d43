"""Receipts: the trainer's signed step records (``protocol/steps.py``) kept in a node's ledger.

Every step record a node hears on the run's ``steps`` topic (signed by the run's trainer, checked by the
gossip validator) names the batches the step took and what became of each: trained on (how many of its
groups and rollouts), every group's rewards equal (nothing to learn from), refused as stale, or dropped
before queuing and why (the record's ``dropped``). With the record's base version and the run's
``run.async_level`` the ledger also tells an accepted batch no record named in time ("dropped without a
record") from one admitted and not yet trained.
:class:`Receipts` writes one ledger row per batch (``config/ledger.Ledger.record_step``), every worker's,
so ``intellect-node ledger`` shows this worker's receipts and ``ledger --all`` every worker's trained
rollouts, from the records alone. Records are gossip, not stored: a node hears the steps taken while it
is in the swarm (the trainer keeps every record as a blob and in ``trainer/records/``).
"""

from __future__ import annotations

import asyncio
import logging

from intellect_node.config.ledger import Ledger, Receipt
from intellect_node.protocol.steps import STEP_KIND, StepRecord, record_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.seams import RoleSwarm

log = logging.getLogger(__name__)


def receipts_of(rec: StepRecord) -> list[Receipt]:
    """The ledger rows of one step record: each batch it took, with its outcome."""
    size = rec.settings.group_size
    out = [Receipt(batch_id=b.cid, worker=b.worker, outcome="trained" if b.trained else "equal_rewards",
                   groups=b.groups, groups_trained=len(b.trained), rollouts_trained=len(b.trained) * size)
           for b in rec.batches]
    out += [Receipt(batch_id=b.cid, worker=b.worker, outcome="stale", groups=b.groups, groups_trained=0,
                    rollouts_trained=0) for b in rec.stale]
    out += [Receipt(batch_id=d.cid, worker=d.worker, outcome=d.reason, groups=0, groups_trained=0,
                    rollouts_trained=0) for d in rec.dropped]
    return out


class Receipts:
    """Keeps every step record heard in ``ledger``; :meth:`subscribe` joins the run's ``steps`` topic."""

    def __init__(self, ledger: Ledger, *, run_id: str, trainer: str, async_level: int) -> None:
        self._ledger = ledger
        self._async_level = async_level
        self._run_id = run_id
        self._trainer = trainer
        self.heard = 0
        self.last_seq = 0

    def subscribe(self, swarm: RoleSwarm) -> None:
        swarm.subscribe(topic(self._run_id, STEP_KIND), record_validator(self._run_id, self._trainer),
                        self.on_record)

    async def on_record(self, rec: StepRecord, origin: str) -> None:
        new = await asyncio.to_thread(self._ledger.record_step, run_id=rec.run_id, seq=rec.seq, step=rec.step,
                                      version=rec.version, receipts=receipts_of(rec),
                                      base_version=rec.base_version, async_level=self._async_level)
        self.heard += 1
        self.last_seq = max(self.last_seq, rec.seq)
        if new:
            log.debug("step record %d (v%d): %d batches recorded", rec.seq, rec.version, new)

    def status(self) -> dict[str, int]:
        return {"heard": self.heard, "last_seq": self.last_seq}
