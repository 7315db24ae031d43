"""A batch from its worker's notice to its verdict: staleness, fetch, an earlier outcome reused, the checks.

:meth:`Verification.check` is steps 1 to 5 of a job (``role.py``'s docstring says what each refuses):
the version window, the fetch from the notice's signer (``validator.fetch_timeout_s`` plus the announced
size at ``validator.fetch_bytes_per_s``), the outcome remembered for the same bytes from the same worker,
strict decoding and the cheap checks of ``checks.py``, then the verifier, in a verification slot of the
worker's pool, its rewards scored in that pool's processes under the worker's budget (``budget.py``).

What it remembers, each in a bounded map or per version:

- the outcome of each batch by worker and content, unless undecided here (``NOT_WORKERS_FAULT``): the
  same bytes again are then checked again, and a ``reward_unjudged`` one counts toward the worker's
  ``validator.unjudged_per_version`` at that version (past it: ``reward_unjudged``, unfetched);
- the rollouts counted (``seen``): a rollout in two batches is a ``duplicate``; a refused batch's are
  released;
- the assignment windows each worker submitted and skipped (``coverage``).

An accepted batch counts for its worker (``reputation.py``: its pool, and sampling after its first
``rl.verify_first_batches``).

Nothing here references the validator: it hands in the policy versions it holds and the newest
announced one, how to fetch a blob, the workers' records and the hops log.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from intellect_node.blobs.fetch import public_reason
from intellect_node.config import NodeConfig
from intellect_node.config.status import StatusBoard, clean_text
from intellect_node.envs.assignment import Assignments, Coverage
from intellect_node.envs.sandbox import Lane, ScoringPool
from intellect_node.envs.tasks import Task
from intellect_node.errors import IntegrityError, IntellectNodeError, ProtocolError
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.proofs.thresholds import Thresholds
from intellect_node.protocol.rl import MAX_DETAIL_LEN, NOT_WORKERS_FAULT, BatchVerdict, RolloutNotice
from intellect_node.protocol.rollout import decode_batch
from intellect_node.roles.common.seen import BoundedMap, SeenRollouts
from intellect_node.roles.validator.budget import ScoringBudgets, ScoringRules
from intellect_node.roles.validator.checks import BatchRules, Fault, check_batch
from intellect_node.roles.validator.hops import HopsLog
from intellect_node.roles.validator.reputation import PEERS_KEPT, POOLS, STATUS_PEERS, Reputation

if TYPE_CHECKING:
    from intellect_node.inference.torch_engine import TorchEngine

log = logging.getLogger(__name__)

NOT_HELD = NOT_WORKERS_FAULT
"""Verdict reasons that are not the worker's fault (the swarm moved on; this validator lacks the policy;
its reward checker ran out of time on a completion a faster node scored)."""
OUTCOMES_KEPT = 8192
"""Entries in each map of what was decided here: outcomes by worker and content, unjudged batches by
worker and version."""

Held = tuple[str, "TorchEngine"]
"""A policy version this validator holds: its checkpoint hash and the engine that prefills it."""
FetchBatch = Callable[[str, str, int, float], Awaitable[bytes]]
"""``fetch(cid, worker, size, timeout)``: the batch blob's bytes, from ``worker``."""


class Verification:
    """The checks of one validator's batches (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, *, task: Task, assignments: Assignments, thresholds: Thresholds,
                 board: StatusBoard, reputation: Reputation, hops: HopsLog, fetch: FetchBatch,
                 held: Callable[[int], Held | None], newest: Callable[[], int]) -> None:
        self._run_id = cfg.run.run_id
        self._async_level = cfg.run.async_level
        self._rl = cfg.rl
        self._vcfg = cfg.validator
        self._task = task
        self._thresholds = thresholds
        self._board = board
        self._reputation = reputation
        self._hops = hops
        self._fetch = fetch
        self._held = held  # the engine of a policy version, when this validator holds it
        self._newest = newest  # the newest version the trainer announced (-1: none yet)
        self._rules = BatchRules(run_id=self._run_id, group_size=self._rl.group_size, task=task,
                                 assignments=assignments)
        self.budgets = ScoringBudgets(ScoringRules.from_config(cfg))
        # Workers with accepted work ("proven") and the rest ("new") each have their own verification
        # slots and scoring processes: fresh keys cannot hold what proven workers need.
        self._slots = {pool: asyncio.Semaphore(self._vcfg.max_verifications) for pool in POOLS}
        self.scorers = {pool: ScoringPool(self._vcfg.scoring_processes) for pool in POOLS}
        self.seen = SeenRollouts()  # the rollouts counted, per version
        self.outcomes: BoundedMap[tuple[str, str], tuple[bool, str, str, str]] = BoundedMap(OUTCOMES_KEPT)
        """(worker, sha256 of the batch) -> (accepted, reason, detail, first CID): resubmissions reuse it."""
        self.unjudged: BoundedMap[tuple[str, int], int] = BoundedMap(OUTCOMES_KEPT)
        """(worker, version) -> its batches left reward_unjudged here (``validator.unjudged_per_version``)."""
        self.coverage = Coverage(PEERS_KEPT)  # the assignment windows each worker submitted and skipped
        self.rng = random.Random()  # which groups get the tensor checks
        self.verify_s = 0.0
        self.counts = {"reused": 0, "verified": 0, "verified_full": 0, "unjudged_budget": 0}

    def close(self) -> None:
        """Stop the scoring processes: a check in a thread stops waiting on its answer."""
        for scorer in self.scorers.values():
            scorer.close()

    def status(self) -> dict[str, object]:
        return {"verify_s": round(self.verify_s, 3),
                "scoring": {**{pool: {"busy": sc.busy, "started": sc.started, "killed": sc.killed}
                               for pool, sc in self.scorers.items()}, **self.budgets.status()},
                "assignments_by_worker": self.coverage.report(STATUS_PEERS)}

    def unjudged_spent(self, worker: str, version: int) -> bool:
        """True (and counted, ``unjudged_budget``) when ``worker`` has had its
        ``validator.unjudged_per_version`` batches at ``version`` left unjudged here."""
        spent = (self.unjudged.get((worker, version)) or 0) >= self._vcfg.unjudged_per_version
        self.counts["unjudged_budget"] += spent
        return spent

    def forget_below(self, floor: int) -> None:
        """Rollouts of versions now stale are refused as such before they are looked up."""
        self.seen.forget_below(floor)

    def verdict(self, notice: RolloutNotice, worker: str, n_ok: int, n_bad: int, reason: str = "",
                 detail: str = "") -> BatchVerdict:
        # Details quote peer-supplied IDs: one line, no control characters, bounded (protocol.rl checks).
        return BatchVerdict(run_id=self._run_id, batch_cid=notice.batch_cid, worker=worker,
                            policy_version=notice.policy_version, accepted=n_bad == 0 and n_ok > 0,
                            n_accepted=n_ok, n_rejected=n_bad, reason=reason[:64],
                            detail=clean_text(detail, MAX_DETAIL_LEN))

    def fetch_deadline(self, size: int) -> float:
        return self._vcfg.fetch_timeout_s + size / self._vcfg.fetch_bytes_per_s

    async def check(self, notice: RolloutNotice, worker: str) -> BatchVerdict:
        n, v = notice.n_rollouts, notice.policy_version
        if v < self._newest() - self._async_level:
            return self.verdict(notice, worker, 0, n, "stale", f"version {v}, newest "
                                f"{self._newest()}, async_level {self._async_level}")
        held = self._held(v)
        if held is None:
            reason = "stale" if v < self._newest() else "policy_version"
            return self.verdict(notice, worker, 0, n, reason, f"no policy v{v} to check against")
        if self.unjudged_spent(worker, v):  # queued before the budget ran out: no fetch, no scoring
            return self.verdict(notice, worker, 0, n, "reward_unjudged", f"not scored: "
                                f"{self._vcfg.unjudged_per_version} batches at v{v} left unjudged here")
        deadline = self.fetch_deadline(notice.batch_bytes)
        try:
            data = await self._fetch(notice.batch_cid, worker, notice.batch_bytes, deadline)
        # Published details are fixed phrases: the exception's text can carry the address, port and answers
        # of a provider the worker chose (a port-scan oracle in every verdict).
        except IntegrityError as exc:  # not the size it announced
            return self.verdict(notice, worker, 0, n, "malformed", public_reason(exc))
        except (IntellectNodeError, asyncio.TimeoutError) as exc:
            log.info("batch %s of %s not fetched: %s", notice.batch_cid, worker, exc)
            return self.verdict(notice, worker, 0, n, "unavailable",
                                f"within {deadline:.0f} s: {public_reason(exc)}")
        self._hops.fetched(worker, notice.batch_cid)
        digest = hashlib.sha256(data).hexdigest()
        prior = self.outcomes.get((worker, digest))
        if prior is not None:  # the same bytes again: no second verification
            self.counts["reused"] += 1
            accepted, reason, detail, first = prior
            if accepted or reason == "duplicate":
                return self.verdict(notice, worker, 0, n, "duplicate", f"the same batch as {first}")
            return self.verdict(notice, worker, 0, n, reason, f"the same batch as {first}: {detail}")
        async with self._slots[self._reputation.pool(worker)]:
            verdict = await self._check_content(notice, worker, data, held)
        if verdict.reason not in NOT_HELD:  # undecided here: the same bytes again are checked again
            self.outcomes.put((worker, digest),
                              (verdict.accepted, verdict.reason, verdict.detail, notice.batch_cid))
        elif verdict.reason == "reward_unjudged":  # ... within the worker's budget at this version
            self.unjudged.put((worker, v), (self.unjudged.get((worker, v)) or 0) + 1)
        return verdict

    async def _check_content(self, notice: RolloutNotice, worker: str, data: bytes,
                             held: Held) -> BatchVerdict:
        n, v = notice.n_rollouts, notice.policy_version
        try:
            batch = await asyncio.to_thread(decode_batch, data)
        except ProtocolError as exc:
            return self.verdict(notice, worker, 0, n, "malformed", str(exc))
        checked = check_batch(batch, notice, worker, self._rules, self.seen)
        if isinstance(checked, Fault):
            return self.verdict(notice, worker, 0, n, checked.reason, checked.detail)
        recs, groups, keys = batch.rollouts, checked.groups, checked.keys
        self.coverage.add(worker, v, checked.window)
        self.seen.add(v, keys)  # reserved now; released below unless accepted
        accepted = False
        try:
            ckpt_hash, engine = held
            expect = Expectations(run_id=self._run_id, policy_version=v, checkpoint_cid=ckpt_hash,
                                  temperature=self._rl.temperature, top_p=1.0,
                                  max_new_tokens=self._rl.max_new_tokens)
            verifier = Verifier(engine, self._thresholds, expect, resolve=self._task.get)
            full = list(range(len(recs)))
            proven = self._reputation.proven(worker)
            everything = self._rl.verify_fraction >= 1.0 or proven < self._rl.verify_first_batches
            if not everything:
                k = max(1, round(len(groups) * self._rl.verify_fraction))
                full = sorted(i for g in self.rng.sample(groups, k) for i in range(g.start, g.stop))
            t0 = time.monotonic()
            # Cheap checks (signature, sanity, reward) on all; tensor checks on the sampled groups only.
            # Rewards are scored in the sender's lane, under a meter charged to it.
            meter = self.budgets.meter(worker, n, t0)
            lane = Lane(self.scorers[self._reputation.pool(worker)], meter)
            checked_idx = set(full)
            try:
                by_record = await asyncio.to_thread(verifier.verify, recs, tensor_checks=checked_idx,
                                                    scoring=lane)
            finally:
                self.budgets.charge(worker, meter, time.monotonic())
            self.verify_s += time.monotonic() - t0
            self.counts["verified"] += 1
            self.counts["verified_full"] += everything
            # The tensor-checked rollouts' verdicts first: the first rejection in this order names the batch.
            verdicts = ([by_record[i] for i in full]
                        + [by_record[i] for i in range(n) if i not in checked_idx])
            bad = [r for r in verdicts if not r.accepted]
            for r in verdicts:
                self._board.proof_checked(r.accepted, reason=r.reason or "")
            if bad:
                # A fault of the worker names the batch before a rollout this validator could not judge.
                first = next((b for b in bad if b.reason not in NOT_HELD), bad[0])
                return self.verdict(notice, worker, n - len(bad), len(bad), first.reason or "rejected",
                                    first.detail)
            accepted = True
            self._reputation.accepted(worker)
            return self.verdict(notice, worker, n, 0)
        finally:
            if not accepted:
                self.seen.discard(v, keys)
