"""Validator role: verify workers' rollout batches, publish signed verdicts, ban repeat offenders.

The parts, each in its own module; none of them references the ``Validator``, which builds them in
``__init__``/``start`` and wires them together in this one place:

- ``intake.py``: ``Intake``, the notices taken in (per peer rates, byte budget and queue, the version
  window, the new-identity rate) and which queued one is worked on next;
- ``checks.py``: ``check_batch``, the cheap checks of a decoded batch (a pure function), before any
  reward is scored or tensor computed;
- ``budget.py``: ``ScoringBudgets``, the scoring time each worker may cost;
- ``verification.py``: ``Verification``, a batch from its notice to its verdict (steps 1 to 5 below):
  fetched, an earlier outcome reused, checked (``checks.py``), verified in its worker's pool;
- ``reputation.py``: ``Reputation``, each worker's record here: its accepted batches (which pool serves
  it), rejections and strikes and the bans they lead to, its verdicts' latency;
- ``publication.py``: ``Publication``, a verdict counted, charged to its worker and gossiped, and the
  accepted ones gossiped again for a trainer that was away;
- ``hops.py``: ``HopsLog``, ``validator/hops.jsonl``: when each verdict's batch came in, was fetched,
  was judged;
- ``evals.py``: ``Evaluations``, the held-out evaluation: its own results and the re-check of others';
- from ``roles/common/``: ``TrainerPolicy`` (``follow.py``), ``HintedFetcher`` (``fetch.py``), the run's
  task and assignments (``tasks.py``), and ``RoleTasks`` (``seams.py``) for the policy and dispatch loops
  and the per-peer jobs; from ``roles/auditor/``: ``ChainAuditor`` (``chain.py``).

The Validator itself holds the policy versions it can check against and the dispatch of the notices
taken in, as jobs.

With ``validator.audit`` on it also replays the trainer's steps from their signed records
(``roles/auditor/chain.py``) and reports the audit state under ``audit`` in its status.

With ``run.eval_every`` on it takes the run's held-out evaluation results (``roles/validator/evals.py``:
re-checked with ``validator.eval_recheck_fraction``), and with ``validator.evaluate`` it evaluates every
``eval_every``-th policy version it loads and signs the result; ``held_out`` in its status.

With ``run.require_audits`` on, a validator stops verifying for a trainer that failed an audit
(``roles/common/audits.py``): notices are dropped as they arrive (``refused_audit`` in its status), the
ones queued are left unverified, no newer policy is adopted, and the node reads ``degraded`` with why.

A notice (signature- and run-checked in the gossip validator, which also drops banned senders and, in a
closed run, peers off ``run.worker_allowlist``) first goes through the intake
(``roles/validator/intake.py``): per peer rates, byte budget and queue, the version window, the new-identity
rate. What it refuses gets no verdict; the reason is recorded against the sender and ``future`` counts as a
strike (``flood``/``busy``, an over-budget or over-full intake, do not: see :mod:`intake`). Taken
notices are worked on as jobs, one per peer at a time, round-robin across peers. Workers with accepted
work here ("proven") and the rest ("new") are served from separate pools, so fresh keys that tarpit or
send slow answers cannot take what honest workers need: ``validator.max_jobs`` jobs,
``validator.max_verifications`` verifications (in threads) and ``validator.scoring_processes`` scoring
processes each. A job:

1. staleness: a batch more than ``run.async_level`` versions behind the newest announced one is ``stale``
   (not held against the worker); one of a version this validator does not hold yet stays parked at the
   head of its sender's queue (others go on) for up to ``validator.policy_wait_s``;
2. the blob is fetched from the notice's signer under a deadline scaled to the announced size; a blob it
   cannot serve in time is ``unavailable`` and counts as a strike (the signer claimed to hold it);
3. the same bytes from the same worker again (another blob name, same content) are not re-verified: the
   earlier outcome is reused (``duplicate`` if they were accepted);
4. strict decoding, then the cheap checks of ``roles/validator/checks.py`` (a pure function): the batch
   matches its notice, every record the signer's, whole groups, the run's task, derived seeds, exactly one
   of the worker's assignment windows at that version (``not_assigned``: ``envs/assignment.py``), no
   rollout already counted (``duplicate``), before any reward is scored or tensor computed;
5. :class:`~intellect_node.inference.verifier.Verifier` with the run's expectations, its rewards scored in
   the sender's pool under a budget charged to the sender (``roles/validator/budget.py``: past it the
   rest is not scored, ``scoring_budget``). ``rl.verify_fraction`` < 1 runs the tensor checks on a random
   subset of groups, except for a worker's first ``rl.verify_first_batches`` accepted batches, which are
   checked in full (a fresh key earns sampling);
6. the verdict is published (``publication.py``). A refusal for what the batch holds counts against
   the worker, and at ``rl.ban_after`` of them it is banned (connections closed, later gossip dropped)
   and the verdict says so: a vote the trainer counts toward ``run.verdict_quorum`` bans;
   ``validator.strikes_ban_after`` strikes ban it too. Accepted verdicts are kept and gossiped again
   when the trainer is heard after a silence (longer than :data:`HEARD_RECENTLY_S`): gossip keeps
   nothing for a peer that is down, so accepted work would otherwise be lost to a trainer restart (it
   ignores the verdicts it had).

A verdict the validator could not decide (``stale``, ``policy_version``, ``reward_unjudged``: see
``protocol.rl.NOT_WORKERS_FAULT``) is not remembered as the batch's outcome: the same bytes sent again are
checked again, never answered from memory (let alone as a ``duplicate``). ``reward_unjudged`` costs this
validator a scoring time limit and a scorer restart each time, so each worker may get
``validator.unjudged_per_version`` of them per version here: past it its queued batches at that version
are answered ``reward_unjudged`` unfetched and unscored, and its new notices at that version are not
taken in (``unjudged_budget``: recorded against it, not a strike).

The same notice again (same worker, same blob) is ignored and not charged: anyone can replay a signed
gossip message once the gossip layer's seen-cache has forgotten it.

The validator keeps an engine for each of the last ``async_level + 1`` policy versions so it can check
rollouts from any version the trainer would still accept, including versions announced while it was
busy (its follower obtains each one in the window, or the delta walk to the newest passes through it:
``keep_passing``). Its engines are the verifier's, the torch engine on ``inference.device`` (it
prefills, it never generates), and its thresholds are the run's for every pair ``run.rollout_engines``
admits against that verifier (``roles/common/engines.py``): a pair not calibrated stops it at start.
"""


from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from intellect_node.config import NodeConfig
from intellect_node.config.schema import ValidatorConfig
from intellect_node.envs.assignment import Assignments
from intellect_node.envs.tasks import Task
from intellect_node.errors import ProtocolError
from intellect_node.inference import make_engine
from intellect_node.models.loader import LoadedModel
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import PolicyAnnouncement
from intellect_node.protocol.rl import NOTICE_KIND, VERDICT_KIND, RolloutNotice, notice_validator
from intellect_node.protocol.rollout import MAX_BATCH_SIZE
from intellect_node.protocol.topics import topic
from intellect_node.roles.auditor.chain import ChainAuditor
from intellect_node.roles.common.audits import audit_gate
from intellect_node.roles.common.engines import run_thresholds
from intellect_node.roles.common.fetch import HintedFetcher
from intellect_node.roles.common.follow import TrainerPolicy
from intellect_node.roles.common.models import base_model, loaded_from_checkpoint, model_dir
from intellect_node.roles.common.run import require_trainer
from intellect_node.roles.common.seams import RoleTasks, Runtime
from intellect_node.roles.common.seen import SeenRollouts
from intellect_node.roles.common.services import blob_service
from intellect_node.roles.common.tasks import run_assignments, run_task
from intellect_node.roles.validator.evals import Evaluations
from intellect_node.roles.validator.hops import HopsLog
from intellect_node.roles.validator.intake import Intake, Limits, Pending
from intellect_node.roles.validator.publication import Publication
from intellect_node.roles.validator.reputation import POOLS, Reputation
from intellect_node.roles.validator.verification import Held, Verification

log = logging.getLogger(__name__)

HEARD_RECENTLY_S = 10.0
"""The trainer counts as in earshot this long after its last announcement (it repeats one every 2 s)."""


class Validator:
    name = "validator"

    # -- set in __init__: the run's settings ------------------------------------------------------
    rt: Runtime
    cfg: NodeConfig
    vcfg: ValidatorConfig
    run_id: str
    async_level: int
    allowed: frozenset[str]  # run.worker_allowlist (empty: an open run)
    task: Task
    assignments: Assignments  # each worker's problems (envs/assignment.py)
    base: LoadedModel  # the run's model without weights: each policy version brings its own
    device: str
    dir: Path  # <data-dir>/validator
    audit_refusal: Callable[[], str]  # "" while the trainer may be verified for

    # -- set in __init__: the parts (see the module docstring) -------------------------------------
    tasks: RoleTasks  # the policy and dispatch loops; per-peer jobs
    intake: Intake
    reputation: Reputation
    hops: HopsLog
    verification: Verification
    publication: Publication
    evals: Evaluations

    # -- set by start() (they need the blob service); None before ---------------------------------
    fetcher: HintedFetcher | None = None
    policy: TrainerPolicy | None = None
    auditor: ChainAuditor | None = None  # only with validator.audit

    # -- the policy: versions announced and held ---------------------------------------------------
    engines: OrderedDict[int, Held]  # version -> (checkpoint hash, engine), the last async_level + 1
    latest_announced: int  # -1: none yet
    _heard_trainer: float  # when the last announcement (new or repeated) came; -inf: never

    # -- intake and dispatch -----------------------------------------------------------------------
    notices: SeenRollouts  # "worker\0CID" of notices taken in, per version (replays are ignored)
    _wake: asyncio.Event  # a notice taken in, a job done, a version held
    _pools: dict[str, int]  # jobs running in each pool
    counts: dict[str, int]  # the intake's tallies (the parts keep theirs)

    def __init__(self, runtime: Runtime) -> None:
        cfg = runtime.config
        require_trainer(cfg, "validator")
        self.rt = runtime
        self.cfg = cfg
        self.vcfg = cfg.validator
        self.run_id = cfg.run.run_id
        self.async_level = cfg.run.async_level
        self.allowed = frozenset(cfg.run.worker_allowlist)
        self.task = run_task(cfg)  # also registers a JSONL task so problem IDs resolve
        self.assignments = run_assignments(cfg, self.task)
        self.base = base_model(cfg)
        self.device = cfg.inference.device
        self.dir = Path(runtime.data_dir) / "validator"
        self.audit_refusal = audit_gate(runtime)

        self.tasks = RoleTasks(runtime, "validator")
        self.intake = Intake(Limits.from_config(self.vcfg, max_batch_bytes=MAX_BATCH_SIZE),
                             exempt=self.allowed)
        self.reputation = Reputation(runtime.swarm, self.tasks, ban_after=cfg.rl.ban_after,
                                     strikes_ban_after=self.vcfg.strikes_ban_after, on_ban=self.intake.forget)
        self.hops = HopsLog(self.dir)
        self.verification = Verification(cfg, task=self.task, assignments=self.assignments,
                                         thresholds=run_thresholds(cfg, model_dir(cfg)), board=runtime.board,
                                         reputation=self.reputation, hops=self.hops, fetch=self._fetch,
                                         held=self._held_engine, newest=lambda: self.latest_announced)
        self.publication = Publication(runtime.swarm, runtime.board, self.reputation, self.hops,
                                       topic(self.run_id, VERDICT_KIND))
        self.evals = Evaluations(cfg, runtime.swarm, runtime.board, self.dir, self._held_engine)

        self.engines = OrderedDict()
        self.latest_announced = -1
        self._heard_trainer = float("-inf")

        self.notices = SeenRollouts()
        self._wake = asyncio.Event()
        self._pools = {pool: 0 for pool in POOLS}
        self.counts = {"replayed": 0, "not_allowed": 0, "refused_audit": 0}

    @classmethod
    def for_runtime(cls, runtime: Runtime) -> "Validator":
        return cls(runtime)

    async def start(self) -> None:
        self.fetcher = HintedFetcher(blob_service(self.rt), self.rt.swarm)
        await self.tasks.open()
        if self.cfg.validator.audit:  # the trainer's steps replayed from its records (roles/auditor/)
            # made before the policy is followed: it notes every announcement (``_on_announcement``)
            self.auditor = ChainAuditor(self.cfg, swarm=self.rt.swarm, fetcher=self.fetcher,
                                        trainer=require_trainer(self.cfg, "validator"),
                                        directory=Path(self.rt.data_dir) / "auditor")
        self.policy = TrainerPolicy(self.rt, self.fetcher, self.dir / "policy", self.tasks, self._add_engine,
                                    on_announcement=self._on_announcement, keep_passing=self.async_level)
        await self.policy.start()
        self.rt.swarm.subscribe(topic(self.run_id, NOTICE_KIND), self._notice_validator(), self._on_notice)
        self.tasks.loop("validator-loop", self._dispatch_loop)
        if self.evals.every:  # held-out results heard (and, with validator.evaluate, made): evals.py
            self.evals.subscribe()
            self.tasks.loop("validator-evals", self.evals.run)
        if self.auditor is not None:
            self.auditor.start()
            self.tasks.loop("validator-audit", self.auditor.run, may_end=True)

    async def close(self) -> None:
        self.verification.close()  # first: a check in a thread stops waiting on its answer
        await self.tasks.close()
        self.evals.close()
        self.hops.close()
        if self.fetcher is not None:
            self.fetcher.close()

    def status(self) -> dict[str, object]:
        return {"versions_held": list(self.engines), "queue": self.intake.queued(), **self.counts,
                **self.verification.counts, **self.publication.counts, **self.reputation.counts,
                "jobs": dict(self._pools), "intake": self.intake.status(),
                "audit": self.auditor.status() if self.auditor is not None else None,
                "audit_refusal": self.audit_refusal(),
                "refused_announcements": self.policy.refused_announcements if self.policy is not None else 0,
                # seconds since the trainer's last announcement (None: never heard)
                "trainer_silent_s": (round(time.monotonic() - self._heard_trainer, 1)
                                     if self._heard_trainer > float("-inf") else None),
                **self.reputation.status(),  # rejections, reasons and strikes by worker; latency_s
                **self.verification.status(),  # verify_s, scoring, assignments_by_worker
                "held_out": self.evals.status()}

    def _notice_validator(self) -> Callable[[bytes, str], tuple[RolloutNotice, str]]:
        """The protocol's notice check plus a count of the closed run's refusals (trio thread)."""
        check = notice_validator(self.run_id, allowed=self.allowed or None)

        def validate(data: bytes, origin: str) -> tuple[RolloutNotice, str]:
            try:
                return check(data, origin)
            except ProtocolError as exc:
                if str(exc).startswith("not_allowed"):
                    self.counts["not_allowed"] += 1
                raise

        return validate

    # -- policy ----------------------------------------------------------------------------------

    def _on_announcement(self, ann: PolicyAnnouncement) -> None:
        """Every valid announcement, repeats included (``roles/common/follow.py`` obtains the versions)."""
        now, last = time.monotonic(), self._heard_trainer
        self._heard_trainer = now
        if self.auditor is not None:
            self.auditor.announced(ann)
        if now - last > HEARD_RECENTLY_S:  # back after a silence (or heard for the first time)
            since = last - HEARD_RECENTLY_S  # what it may have missed: from before the silence showed
            missed = self.publication.missed_since(since)
            if missed:
                self.tasks.job(self.publication.resend(missed), "re-sending verdicts the trainer missed")
        if ann.version > self.latest_announced:
            self.latest_announced = ann.version
            self._forget_stale()
            self._wake.set()

    def _forget_stale(self) -> None:
        """Rollouts and notices of versions now stale are refused as such before they are looked up."""
        floor = self.latest_announced - self.async_level
        self.verification.forget_below(floor)
        self.notices.forget_below(floor)

    async def _add_engine(self, version: int, ckpt: PolicyWeights) -> None:
        if version in self.engines and self.engines[version][0] == ckpt.content_hash:
            return  # passed again (a delta walk retried from the full checkpoint): already held
        loaded = await asyncio.to_thread(loaded_from_checkpoint, self.base, ckpt)
        engine = await asyncio.to_thread(make_engine, loaded, "torch", device=self.device)
        if self.policy is not None and self.policy.refused_after_load(version, holding=bool(self.engines)):
            return
        self.engines[version] = (ckpt.content_hash, engine)
        while len(self.engines) > self.async_level + 1:  # the oldest versions go, whatever the arrival order
            del self.engines[min(self.engines)]
        self.latest_announced = max(self.latest_announced, version)
        self._forget_stale()
        self._wake.set()
        self.evals.policy_loaded(version, ckpt.content_hash, engine)

    def _held_engine(self, version: int) -> Held | None:
        return self.engines.get(version)

    async def _fetch(self, cid: str, worker: str, size: int, timeout: float) -> bytes:
        assert self.fetcher is not None, "jobs run only after start()"
        return await self.fetcher.fetch(cid, holders=[worker], max_size=MAX_BATCH_SIZE, size=size,
                                        timeout=timeout)

    def _decidable(self, version: int) -> bool:
        """A notice of ``version`` can be judged now: its policy is held, or it never will be (older than
        the newest held, or stale)."""
        return version in self.engines or version < max(self.engines, default=-1) \
            or version < self.latest_announced - self.async_level

    # -- intake and dispatch ---------------------------------------------------------------------

    def _on_notice(self, msg: tuple[RolloutNotice, str], origin: str) -> None:
        notice, worker = msg
        if self.rt.swarm.is_banned(worker):
            return
        if self.audit_refusal():  # run.require_audits: no verification for a trainer that failed one
            self.counts["refused_audit"] += 1
            return
        taken = [f"{worker}\0{notice.batch_cid}"]
        if self.notices.first_seen(notice.policy_version, taken) is not None:
            self.counts["replayed"] += 1
            return
        if self.verification.unjudged_spent(worker, notice.policy_version):  # counted there
            self.rt.swarm.peerbook.record_rejection(
                worker, f"notice {notice.batch_cid}: unjudged_budget: {self.vcfg.unjudged_per_version} "
                f"batches at v{notice.policy_version} left unjudged here", counts=False)
            return
        refusal = self.intake.offer(worker, notice, time.monotonic(), self.latest_announced)
        if refusal is not None:
            self.rt.swarm.peerbook.record_rejection(
                worker, f"notice {notice.batch_cid}: {refusal.reason}: {refusal.detail}",
                counts=refusal.strike)
            if refusal.strike:
                self.reputation.strike(worker, refusal.reason)
            return
        self.notices.add(notice.policy_version, taken)
        self._wake.set()

    async def _dispatch_loop(self) -> None:
        while True:
            self._wake.clear()
            if self.audit_refusal():  # what is queued stays unverified (see the module docstring)
                await asyncio.sleep(1.0)
                continue
            now = time.monotonic()
            for p in self.intake.take(now, self._decidable, self._grant):
                self.tasks.job(self._job(p, self.reputation.pool(p.worker)),
                               f"checking batch {p.notice.batch_cid} from {p.worker}")
            for p in self.intake.expired(now):
                self.tasks.job(self._expire(p), f"expiring batch {p.notice.batch_cid} from {p.worker}")
            delay = self.intake.next_event(now)
            try:
                await asyncio.wait_for(self._wake.wait(), 5.0 if delay is None else max(delay, 0.01))
            except asyncio.TimeoutError:
                pass

    def _grant(self, worker: str) -> bool:
        pool = self.reputation.pool(worker)
        if self._pools[pool] >= self.vcfg.max_jobs:
            return False
        self._pools[pool] += 1
        return True

    async def _job(self, p: Pending, pool: str) -> None:
        try:
            verdict = await self.verification.check(p.notice, p.worker)
            await self.publication.publish(verdict, p.worker, arrived=p.arrived)
        finally:
            self._pools[pool] -= 1
            self.intake.done(p.worker)
            self._wake.set()

    async def _expire(self, p: Pending) -> None:
        """A parked notice whose version did not arrive in time. A version the trainer has not announced
        while we hear it (it repeats its newest every 2 s) was a lie: a strike. One announced but not
        obtained here, or any while the trainer is out of earshot, is not the worker's fault."""
        v = p.notice.policy_version
        lie = v > self.latest_announced >= 0 and time.monotonic() - self._heard_trainer < HEARD_RECENTLY_S
        # A lie is the worker's fault ("future", a strike); the trainer must read it as such, not as an
        # abstention ("policy_version").
        reason = "future" if lie else "policy_version"
        verdict = self.verification.verdict(p.notice, p.worker, 0, p.notice.n_rollouts, reason,
                                            f"no policy v{v} after {self.vcfg.policy_wait_s:.0f} s (newest "
                                            f"announced v{self.latest_announced})")
        await self.publication.publish(verdict, p.worker, arrived=p.arrived)
