"""The trainer's intake: a batch from a worker's notice to the training queue, and who is blamed on the way.

The gossip handlers of the ``rollouts`` and ``verdicts`` topics:

- :meth:`BatchIntake.on_notice`: a worker's notice starts fetching and decoding its batch while the
  validators verify it (``prefetch.py``), and is remembered (a ban vote may name the batch);
- :meth:`BatchIntake.on_verdict`: a verdict is acted on only inside a time window around this node's clock
  (``protocol.rl.verdict_time_error``: an old one replayed is ignored, at the gossip validator already,
  the validator named in the log once).
  ``Admission.decide`` (``admission.py``) says what it does: count a vote, refuse the batch, count it
  stale, abstain (a reason that is not the worker's fault: the validator lags or lacks the policy) or
  admit it. In a closed run (``run.worker_allowlist``) other workers' batches are refused
  (``not_allowed``).

Admitting a batch: keep the sealed acceptances that made the quorum (the evidence its step record will
carry, ``protocol/steps.py``), take the prefetched copy or fetch it (from the worker, and the validator,
which holds it), check and re-score it (``rescore.py``), persist it to the inbox with its rollout keys and
that evidence (``inbox.py``: a batch holding a rollout admitted before is refused as ``duplicate`` whatever
its CID), then queue it. An accepted batch not queued (already stale, refused here, its worker banned or
not allowed, its blob not to be had) is named with why in the next step record
(:meth:`BatchIntake.drain_dropped`), so an auditor can tell it from one dropped in silence. A refusal that
is the worker's doing is recorded against it and ``rl.ban_after`` of them ban it. A verdict carrying
``ban`` is one validator's vote: ``run.verdict_quorum`` of them, each about a batch the worker itself
announced (its notice was heard here), ban the worker; the run's trainer and
validators are never banned by verdicts (``Admission.bans``).

Nothing here references the trainer: it hands in the policy version it is at, the batches it consumed,
how to fetch a blob, and what to do once a batch is queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from intellect_node.config.status import StatusBoard
from intellect_node.envs.assignment import Coverage
from intellect_node.errors import IntellectNodeError
from intellect_node.protocol.rl import BatchVerdict, RolloutNotice, now_ms, verdict_time_error
from intellect_node.protocol.rollout import MAX_BATCH_SIZE, RolloutBatch, decode_batch
from intellect_node.protocol.steps import DROP_REASONS, DroppedBatch
from intellect_node.roles.common.rescore import RefusedBatch, Rescorer
from intellect_node.roles.common.seams import RoleSwarm
from intellect_node.roles.common.seen import BoundedMap, rollout_keys
from intellect_node.roles.trainer.admission import Admission
from intellect_node.roles.trainer.batching import Accepted, fresh_floor, vote_key
from intellect_node.roles.trainer.inbox import Inbox
from intellect_node.roles.trainer.prefetch import Prefetch

log = logging.getLogger(__name__)

PEERS_KEPT = 65536
"""Workers whose refusals are counted here, and notices remembered (what a peer can make us hold)."""
HOPS_KEPT = 1024
"""Batches whose hop times are remembered for the metrics line of the step that takes them."""
DROPPED_KEPT = 4096
"""Accepted batches dropped without queuing, held until a step record names them; more: the oldest go."""
DROPPED_PER_RECORD = 256
"""Most of them one step record names (the rest wait for the next)."""

FetchBatch = Callable[[str, Sequence[str], "int | None"], Awaitable[bytes]]
"""``fetch(cid, holders, size)``: a batch blob's bytes, from ``holders`` first (at most MAX_BATCH_SIZE)."""


def with_envelope(validate: Callable[[bytes, str], tuple[BatchVerdict, str]]
                  ) -> Callable[[bytes, str], tuple[BatchVerdict, str, bytes]]:
    """A verdict gossip validator that also hands on the envelope it checked (the evidence kept)."""

    def check(data: bytes, origin: str) -> tuple[BatchVerdict, str, bytes]:
        verdict, signer = validate(data, origin)
        return verdict, signer, bytes(data)

    return check


class BatchIntake:
    """The notices and verdicts of one run, for a trainer (see the module docstring)."""

    def __init__(self, *, swarm: RoleSwarm, board: StatusBoard, admission: Admission, inbox: Inbox,
                 rescorer: Rescorer, fetch: FetchBatch, version: Callable[[], int],
                 consumed: Callable[[str], bool], on_queued: Callable[[], None], async_level: int,
                 ban_after: int) -> None:
        self._swarm = swarm
        self._board = board
        self._admission = admission
        self._inbox = inbox
        self._rescorer = rescorer
        self._fetch = fetch
        self._version = version
        self._consumed = consumed
        self._on_queued = on_queued
        self._async_level = async_level
        self._ban_after = ban_after
        self.prefetch = Prefetch(self._prefetch_one)
        self.counts = {"accepted_batches": 0, "rejected_batches": 0, "stale_batches": 0,
                       "accepted_rollouts": 0, "rejected_rollouts": 0, "stale_rollouts": 0, "banned": 0,
                       "duplicate_batches": 0, "not_allowed_batches": 0, "wrong_task_batches": 0,
                       "bad_signature_batches": 0, "abstained_verdicts": 0, "expired_verdicts": 0,
                       "ban_votes": 0, "not_assigned_batches": 0, "nonfinite_batches": 0}
        self.refusals: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)  # worker -> batches refused here
        self.coverage = Coverage(PEERS_KEPT)  # the windows each worker's admitted batches filled and skipped
        self._heard: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)  # vote_key of notices heard -> version
        self._clock_warned: set[str] = set()  # validators whose verdicts came outside the time window
        self.hops: BoundedMap[str, dict[str, float]] = BoundedMap(HOPS_KEPT)  # batch CID -> hop -> wall time
        self._dropped: dict[str, DroppedBatch] = {}  # accepted, not queued, not yet named by a record

    def drop(self, worker: str, cid: str, reason: str) -> None:
        """An accepted batch not queued: the next step record names it (``reason``: one of DROP_REASONS)."""
        if cid in self._dropped:
            return
        self._dropped[cid] = DroppedBatch(cid=cid, worker=worker,
                                          reason=reason if reason in DROP_REASONS else "refused")
        while len(self._dropped) > DROPPED_KEPT:
            del self._dropped[next(iter(self._dropped))]

    def drain_dropped(self, named: Sequence[str] = ()) -> list[DroppedBatch]:
        """The dropped batches for the next step record (at most DROPPED_PER_RECORD), oldest first; those
        in ``named`` (the record takes them after all: a later verdict admitted them) are left out."""
        out: list[DroppedBatch] = []
        for cid in list(self._dropped)[:DROPPED_PER_RECORD]:
            d = self._dropped.pop(cid)
            if cid not in named:
                out.append(d)
        return out

    def count_stale(self, n: int) -> None:
        """A batch (of ``n`` rollouts) refused as stale: by a verdict, or left in the queue too long."""
        self.counts["stale_batches"] += 1
        self.counts["stale_rollouts"] += n

    def _hop(self, cid: str, hop: str, t: float | None = None) -> None:
        got = self.hops.get(cid) or {}
        got.setdefault(hop, time.time() if t is None else t)
        self.hops.put(cid, got)

    # -- notices ---------------------------------------------------------------------------------

    def on_notice(self, msg: tuple[RolloutNotice, str], origin: str) -> None:
        """A worker's notice: fetch its batch while the validators verify it."""
        notice, worker = msg
        if self._swarm.is_banned(worker):
            return
        self._heard.put(vote_key(worker, notice.batch_cid), notice.policy_version)  # a ban may name it
        if notice.batch_bytes > MAX_BATCH_SIZE:
            return
        version = self._version()
        floor = fresh_floor(version, self._async_level)
        if self.prefetch.offer(worker, notice.batch_cid, notice.policy_version, notice.batch_bytes, floor,
                               version):
            self._hop(notice.batch_cid, "notice")

    async def _prefetch_one(self, worker: str, cid: str, size: int) -> tuple[bytes, RolloutBatch]:
        data = await self._fetch(cid, [worker], size)
        return data, await asyncio.to_thread(decode_batch, data)

    # -- verdicts --------------------------------------------------------------------------------

    def verdict_late(self, verdict: BatchVerdict, validator: str, why: str) -> None:
        """A replay, or this validator's clock is off: nothing in it is acted on. Called on the libp2p
        thread by the gossip validator (which drops it unforwarded and blames no one), or below."""
        self.counts["expired_verdicts"] += 1
        if validator not in self._clock_warned:
            self._clock_warned.add(validator)
            log.warning("verdicts of validator %s ignored: %s (logged once per validator)", validator, why)

    async def on_verdict(self, msg: tuple[BatchVerdict, str, bytes], origin: str) -> None:
        """A verdict (with its sealed envelope, the evidence a step record carries)."""
        verdict, validator, raw = msg
        late = verdict_time_error(verdict, now_ms())
        if late:  # expired between the gossip validator and here
            self.verdict_late(verdict, validator, late)
            return
        if verdict.ban:
            await self._ban_vote(verdict, validator)
        w, cid = verdict.worker, verdict.batch_cid
        decision = self._admission.decide(verdict, validator, version=self._version(),
                                          consumed=self._consumed(cid), banned=self._swarm.is_banned(w),
                                          raw=raw)
        if decision in ("not_allowed", "stale", "banned") and verdict.accepted:
            self.drop(w, cid, decision)
        if decision == "not_allowed":
            self.counts["not_allowed_batches"] += 1
            self._swarm.peerbook.record_rejection(w, f"batch {cid}: not_allowed "
                                                     "(not on run.worker_allowlist)")
        elif decision == "refuse":
            self.counts["rejected_batches"] += 1
            self.counts["rejected_rollouts"] += verdict.n_accepted + verdict.n_rejected
            self._board.verdict(False, verdict.n_accepted + verdict.n_rejected, reason=verdict.reason,
                                detail=verdict.detail, peer=w)
        elif decision == "stale":
            self.count_stale(verdict.n_accepted)
        elif decision == "abstain":
            self.counts["abstained_verdicts"] += 1
        elif decision == "admit":
            self._hop(cid, "verdict")
            await self._take_in(verdict, validator, self._admission.evidence(w, cid))

    async def _take_in(self, verdict: BatchVerdict, validator: str, evidence: tuple[bytes, ...]) -> None:
        """Fetch (or take the prefetched copy), check and persist a batch its validators accepted, then
        queue it."""
        w, cid = verdict.worker, verdict.batch_cid
        try:
            acc = await self._admit(verdict, validator, evidence)
        except asyncio.CancelledError:
            raise
        except RefusedBatch as exc:
            self._admission.refused(w, cid)
            self.drop(w, cid, exc.reason)
            await self._refuse(verdict, validator, exc)
            return
        except IntellectNodeError as exc:
            self._admission.failed(w, cid)  # another validator's verdict may bring it again
            self.drop(w, cid, "unavailable")  # left out of the record should it be taken after all
            log.warning("accepted batch %s could not be admitted: %s", cid, exc)
            return
        self._hop(cid, "admitted")
        self.counts["accepted_batches"] += 1
        self.counts["accepted_rollouts"] += verdict.n_accepted
        self._board.verdict(True, verdict.n_accepted, peer=w)
        self._admission.add(acc)
        self._on_queued()

    async def _admit(self, verdict: BatchVerdict, validator: str, evidence: tuple[bytes, ...]) -> Accepted:
        w, cid, version = verdict.worker, verdict.batch_cid, verdict.policy_version
        banned = self._swarm.is_banned(w)  # accepted before its ban: the validator holds the batch
        got = await self.prefetch.claim(w, cid, wait=not banned)
        if got is not None:
            data, batch, arrived = got
            self._hop(cid, "prefetched", arrived)
        else:  # not prefetched (or that failed): from the worker or the validator, which holds it
            data = await self._fetch(cid, [validator] if banned else [w, validator], None)
            batch = await asyncio.to_thread(decode_batch, data)
        # re-scoring runs checkers (math-verify: ~12 ms a rollout, up to rl.reward_timeout_s on hostile
        # text): off the event loop
        groups = await asyncio.to_thread(self._rescorer.groups, batch, w, version)
        window = self._rescorer.window_of(w, version, batch.rollouts[0].problem_id)
        if window is not None:  # always: groups() refuses a batch outside the worker's assignment
            self.coverage.add(w, version, window)
        seq = await self._inbox.admit(cid, w, version, data, rollout_keys(batch.rollouts), evidence)
        return Accepted(cid, w, version, groups, seq, evidence)

    # -- blame -----------------------------------------------------------------------------------

    async def _ban_vote(self, verdict: BatchVerdict, validator: str) -> None:
        """One validator's vote to ban the verdict's worker: counted only for a batch that worker announced
        itself (its signed notice was heard here), so no verdict can name an uninvolved peer."""
        w = verdict.worker
        if self._swarm.is_banned(w):
            return
        if vote_key(w, verdict.batch_cid) not in self._heard:
            log.info("ban of %s by validator %s not counted: no notice of batch %s heard from it", w,
                     validator, verdict.batch_cid)
            return
        self.counts["ban_votes"] += 1
        bans = self._admission.bans
        if bans.vote(w, validator):
            await self._swarm.ban(w, f"banned by {bans.quorum} validator(s), last {validator}: "
                                     f"{verdict.reason}")
            self.counts["banned"] += 1

    async def _refuse(self, verdict: BatchVerdict, validator: str, exc: RefusedBatch) -> None:
        """A batch its validators accepted that the trainer refuses itself. Rollouts admitted before
        (``duplicate``), of another task (``wrong_task``) or outside its assignment (``not_assigned``) are
        the worker's doing (only it signs its records), so they count against it and ``rl.ban_after`` of
        them ban it; records whose signature is not the worker's (``bad_signature``) are not: whoever
        served them (the validator) is named."""
        w, detail = verdict.worker, str(exc)
        self.counts["rejected_rollouts"] += verdict.n_accepted
        key = {"duplicate": "duplicate_batches", "wrong_task": "wrong_task_batches",
               "bad_signature": "bad_signature_batches",
               "not_assigned": "not_assigned_batches"}.get(exc.reason)
        if key is not None:
            self.counts[key] += 1
        if not exc.workers_fault:
            log.warning("batch %s accepted by validator %s refused: %s (%s); not held against %s",
                        verdict.batch_cid, validator, exc.reason, detail, w)
            return
        await self.charge(w, verdict.batch_cid, exc.reason, detail, verdict.n_accepted)

    async def charge(self, w: str, cid: str, reason: str, detail: str, n_rollouts: int) -> None:
        """Hold a batch the trainer refused (here, or after it made a step non-finite: ``nonfinite``)
        against its worker: ``rl.ban_after`` of them ban it."""
        if reason == "nonfinite":
            self.counts["nonfinite_batches"] += 1
        n = (self.refusals.get(w) or 0) + 1
        self.refusals.put(w, n)
        self._swarm.peerbook.record_rejection(w, f"batch {cid}: {reason}: {detail}")
        self._board.verdict(False, n_rollouts, reason=reason, detail=detail, peer=w)
        log.warning("batch %s from %s refused: %s (%s)", cid, w, reason, detail)
        if n >= self._ban_after and not self._swarm.is_banned(w):
            await self._swarm.ban(w, f"{n} batches refused, last: {reason}")
            self.counts["banned"] += 1
