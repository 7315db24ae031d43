"""The reasons a step record gives for accepted batches it dropped, checked where the batch shows them.

A record names every batch its validators accepted that the trainer did not queue, with a reason
(``protocol/steps.py``, ``dropped``). Four reasons are facts about the batch, so an auditor need not take
them at the trainer's word:

1. ``not_assigned`` and ``wrong_task``: the auditor fetches the batch (from its worker or the trainer, as
   it fetches the batches a step took) and runs the trainer's own check on it, the run's task and the
   worker's assignment at the batch's version (``roles/trainer/rescore.Rescorer.groups``, through
   ``inputs.trainer_refusal``). A batch that check takes was an honest batch dropped: the step fails.
2. ``duplicate``: the trainer refuses a batch holding a rollout key (``roles/common/seen.rollout_keys``)
   it admitted before at that version (``roles/trainer/inbox.py``), and every batch it admitted is
   named by a record, taken or ``stale``. So the claim holds when another batch of the same worker at
   the same version that a record names taken or stale holds one of its keys. That batch may wait in the
   trainer's queue past the record naming the drop, so the claim is judged when the records reach the
   version where the batch it repeats must have been named (its version + ``run.async_level`` + 1, and
   :data:`~intellect_node.roles.auditor.evidence.DROP_SLACK_VERSIONS` for a record in flight), against the
   batches named by records of base versions from its version to there.
3. ``stale``: ``evidence.py`` (the batch's version from the verdicts heard).

The others (``refused``, ``banned``, ``not_allowed``, ``unavailable``, ``bad_signature``) are the trainer's
word: nothing in the batch shows them.

A batch the auditor cannot fetch makes the check ``unavailable`` (never a pass, never a fail), and so
does a ``duplicate`` claim judged while a record that could name the batch it repeats was not heard (the
auditor joined later, or missed one). A batch that does not decode is no honest batch, whatever the
reason given. Memory is bounded: the base versions of the newest :data:`RECORDS_KEPT` records, the
newest :data:`NAMED_PER_WORKER` batches named per worker, :data:`CLAIMS_KEPT` duplicate claims waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from intellect_node.errors import IntellectNodeError
from intellect_node.protocol.rollout import RolloutBatch, decode_batch
from intellect_node.protocol.steps import StepRecord
from intellect_node.roles.auditor.evidence import DROP_SLACK_VERSIONS
from intellect_node.roles.auditor.replay import Outcome
from intellect_node.roles.common.seen import BoundedMap, rollout_keys

log = logging.getLogger(__name__)

CHECKED = ("not_assigned", "wrong_task", "duplicate")
"""Drop reasons an auditor checks here (``stale`` is ``evidence.py``'s)."""
RECORDS_KEPT = 65536
"""Records whose base version is remembered (to tell whether every record of a range was heard)."""
NAMED_PER_WORKER = 64
"""Batches named taken or stale kept per worker, the newest: a duplicate's original is among the few
named while its version was fresh."""
WORKERS_KEPT = 65536
CLAIMS_KEPT = 1024
"""Duplicate claims waiting for their deadline; beyond, the oldest are forgotten (not judged)."""

Fetch = Callable[[str, str], Awaitable[bytes | None]]
"""A batch's bytes by (CID, worker), from its worker or the trainer; None when not to be had."""
Refusal = Callable[[RolloutBatch, str], str]
"""The trainer's own check of a batch of a worker: the reason it refuses it, "" when it takes it."""


@dataclass(frozen=True)
class _Claim:
    """A batch recorded dropped as ``duplicate``: its worker, its rollouts' version and the record."""

    worker: str
    version: int
    seq: int


class DropCheck:
    """An auditor's checks of the drop reasons (see the module docstring): every record heard goes to
    :meth:`named`, each record audited to :meth:`check`, in order. ``refusal``: the trainer's own check
    (``inputs.trainer_refusal``); ``async_level``: ``run.async_level``."""

    def __init__(self, refusal: Refusal, async_level: int) -> None:
        self._refusal = refusal
        self._async_level = async_level
        self._bases: BoundedMap[int, int] = BoundedMap(RECORDS_KEPT)  # seq -> base version
        # worker -> the batches records named taken or stale: (CID, the record's base version)
        self._named: BoundedMap[str, list[tuple[str, int]]] = BoundedMap(WORKERS_KEPT)
        self._claims: dict[str, _Claim] = {}  # CID -> a duplicate claim not judged yet
        self.checked = 0
        """Drop reasons checked and found to hold (status)."""

    def named(self, rec: StepRecord) -> None:
        """Note a record heard (audited or not): its base version, and the batches it took or named
        stale, the ones a duplicate may repeat."""
        self._bases.put(rec.seq, rec.base_version)
        for b in (*rec.batches, *rec.stale):
            kept = [n for n in self._named.get(b.worker) or [] if n[0] != b.cid]
            self._named.put(b.worker, [*kept, (b.cid, rec.base_version)][-NAMED_PER_WORKER:])

    async def check(self, rec: StepRecord, fetch: Fetch) -> tuple[Outcome, str]:
        """``rec``'s drop reasons checked (its own, and the duplicate claims whose deadline ``rec``
        reaches): ``pass``, or ``fail``/``unavailable`` with why."""
        for d in rec.dropped:
            if d.reason not in CHECKED:
                continue
            got = await self._batch(d.cid, d.worker, fetch)
            if got is None:
                return "unavailable", (f"batch {d.cid} of worker {d.worker}, recorded dropped ({d.reason}), "
                                       "not fetched: its reason is not checked")
            if isinstance(got, str):  # no honest batch, whatever the reason given
                continue
            if d.reason == "duplicate":
                self._claims.setdefault(d.cid, _Claim(d.worker, got.policy_version, rec.seq))
                while len(self._claims) > CLAIMS_KEPT:
                    del self._claims[next(iter(self._claims))]
                continue
            refused = await asyncio.to_thread(self._refusal, got, d.worker)
            if not refused:
                return "fail", (f"batch {d.cid} of worker {d.worker} recorded dropped ({d.reason}), but the "
                                f"trainer's own check takes it (rollouts of v{got.policy_version}): an "
                                "accepted batch dropped")
            self.checked += 1
        return await self._duplicates(rec, fetch)

    async def _batch(self, cid: str, worker: str, fetch: Fetch) -> RolloutBatch | str | None:
        """The batch decoded; None when not fetched, why when it does not decode."""
        data = await fetch(cid, worker)
        if data is None:
            return None
        try:
            return await asyncio.to_thread(decode_batch, data)
        except IntellectNodeError as exc:
            return f"does not decode: {exc}"

    def _deadline(self, claim: _Claim) -> int:
        return claim.version + self._async_level + 1 + DROP_SLACK_VERSIONS

    async def _duplicates(self, rec: StepRecord, fetch: Fetch) -> tuple[Outcome, str]:
        for cid, claim in list(self._claims.items()):
            if rec.base_version < self._deadline(claim):
                continue
            del self._claims[cid]
            outcome, why = await self._judge(cid, claim, rec, fetch)
            if outcome != "pass":
                return outcome, why
            self.checked += 1
        return "pass", ""

    async def _judge(self, cid: str, claim: _Claim, rec: StepRecord, fetch: Fetch) -> tuple[Outcome, str]:
        what = (f"batch {cid} of worker {claim.worker}, recorded dropped as a duplicate by step "
                f"{claim.seq}")
        got = await self._batch(cid, claim.worker, fetch)
        if not isinstance(got, RolloutBatch):
            return "unavailable", f"{what}, not fetched again: its reason is not checked"
        keys = set(rollout_keys(got.rollouts))
        unfetched = 0
        deadline = self._deadline(claim)
        for other, base in self._named.get(claim.worker) or []:
            if other == cid or not claim.version <= base <= deadline:
                continue
            b = await self._batch(other, claim.worker, fetch)
            if b is None:
                unfetched += 1
            elif isinstance(b, RolloutBatch) and b.policy_version == claim.version \
                    and keys.intersection(rollout_keys(b.rollouts)):
                return "pass", ""
        if unfetched:
            return "unavailable", f"{what}: {unfetched} batch(es) that may hold its rollouts not fetched"
        if not self._heard_from(claim.version, rec.seq):
            return "unavailable", f"{what}: not every record that could name the batch it repeats was heard"
        return "fail", (f"{what}, but no batch a record took or named stale holds any of its rollouts of "
                        f"v{claim.version}: an accepted batch dropped")

    def _heard_from(self, version: int, seq: int) -> bool:
        """Whether every record from the first of base ``version`` or later up to ``seq`` was heard."""
        s = seq
        while s >= 1 and (base := self._bases.get(s)) is not None and base >= version:
            s -= 1
        return s == 0 or s in self._bases
