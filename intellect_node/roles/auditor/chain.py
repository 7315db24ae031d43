"""The chain auditor: a validator that replays windows of training steps from the trainer's signed records.

With ``validator.audit`` on, a validator runs a :class:`ChainAuditor` beside its checks. It hears the
step records on the run's ``steps`` topic and keeps them by journal sequence number. Its
:class:`~intellect_node.roles.auditor.windows.WindowPlan` picks the windows to audit (each with probability
``validator.audit_fraction``, from this node's own randomness: ``windows.py``); for each:

1. the start: version 0 (the run's model as this node loads it, a fresh optimizer), or a record carrying
   ``state``, whose weights and optimizer blobs it fetches through the swarm (the trainer first, the DHT
   second) at the sizes the run's model gives them (``published.StateSizes``: a manifest stating another
   size is refused before any chunk moves, and the step fails: the trainer signed that blob), each into
   a file it maps rather than reads, and loads after checking them against the hashes the trainer signed
   (``windows.load_start``);
2. the steps, in order from the next record: the evidence that admitted its batches checked, and that no
   batch the validators accepted was dropped without a word (``evidence.py``, from the verdicts it hears
   on the run's ``verdicts`` topic, its own included), nor with a reason its batch does not show
   (``drops.py``: ``not_assigned``, ``wrong_task``, ``duplicate``; a step failing these is not
   replayed), then the
   batches each names fetched through the swarm (from their workers or the trainer), re-scored as the
   trainer does (``inputs.py``) and the step replayed on its own copy of the model (``replay.py``:
   :class:`~intellect_node.roles.auditor.replay.WindowReplay`, the CPU with one torch thread). With
   ``run.audit_tolerance`` above 0, a step whose hash differs is compared with the weights the trainer
   published for it, which the replay (in its worker thread) asks the event loop for (``published.py``:
   the announced delta applied to the step's base, else the full weights blob; the validator hands every
   policy announcement it hears to :meth:`ChainAuditor.announced`), and the replay goes on from them when
   they are within the tolerance;
3. the end: the next record carrying ``state``, where the replay's optimizer state must also be the one
   published (``windows.check_end``; within the tolerance, it is fetched and compared by numbers); the
   next window is drawn there, and when it is audited the replay goes on.

It signs an ``AuditVerdict`` per record replayed (``protocol/audits.py``), and one for a window whose start
could not be had (``unavailable``, never a pass) or was not what the trainer signed (``fail``), naming the
record whose state it is, its reason opening with ``START_REASON`` (every node counts the starts not fetched
towards the run's audit coverage, ``roles/common/audits.py``); gossips it on the run's ``audits`` topic,
appends it to ``auditor/verdicts.jsonl`` and reports the audit state in its status (``audit``: the steps
audited, passed, failed and unavailable, the windows likewise, the first that did not pass, the tolerance and
the published blobs it used). At fraction 1.0 it replays every step heard, from version 0 or from the first
start it hears when it joins later.

Shortcuts: a window ends at its first step that does not pass (its weights no longer follow the published
chain; the auditor waits for the next start) and at a missing record (a sequence number not heard within
:data:`RECORD_WAIT_S` while later ones are, ``unavailable``); records are heard live only, so a window
starts at a record heard after the auditor joined. Every node acts on the verdicts
(``roles/common/audits.py``: shown in status, and with ``run.require_audits`` the trainer is no longer
followed).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from intellect_node.config.schema import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.errors import IntellectNodeError, ProtocolError
from intellect_node.fsutil import append_jsonl
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.audits import AUDIT_KIND, AuditVerdict, seal_verdict
from intellect_node.protocol.policy import PolicyAnnouncement
from intellect_node.protocol.rl import VERDICT_KIND, BatchVerdict, verdict_validator
from intellect_node.protocol.rollout import MAX_BATCH_SIZE
from intellect_node.protocol.steps import STEP_KIND, StepBatch, StepRecord, record_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.auditor.drops import DropCheck
from intellect_node.roles.auditor.evidence import AdmissionCheck, RunRules
from intellect_node.roles.auditor.inputs import batch_groups, run_rescorer, run_settings, trainer_refusal
from intellect_node.roles.auditor.published import PublishedPolicy, StateSizes, fetch_mapped
from intellect_node.roles.auditor.replay import Outcome, PublishedOf, StepAudit, WindowReplay
from intellect_node.roles.auditor.windows import OptimizerOf, Start, WindowPlan, check_end, load_start
from intellect_node.roles.common.audits import START_REASON
from intellect_node.roles.common.fetch import HintedFetcher, WrongSize
from intellect_node.roles.common.models import model_dir
from intellect_node.roles.common.seams import RoleSwarm

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Records held ahead of the one being audited; more are dropped (heard again later or reported missing)."""
RECORD_WAIT_S = 300.0
"""Seconds the next record may stay unheard while later ones are held before it is reported missing."""
FETCH_TIMEOUT_S = 60.0
START_FETCH_TIMEOUT_S = 600.0
"""A window's start is a model's weights and twice that in optimizer state: more time than a batch."""
VERDICTS_FILE = "verdicts.jsonl"


class ChainAuditor:
    """Audits windows of the run's steps (see the module docstring); ``start`` subscribes, ``run`` loops.
    ``draw``: the randomness that picks windows (the system's, secret, unless a test hands one in)."""

    def __init__(self, cfg: NodeConfig, *, swarm: RoleSwarm, fetcher: HintedFetcher, trainer: str,
                 directory: Path, draw: Callable[[], float] | None = None) -> None:
        self._cfg = cfg
        self._swarm = swarm
        self._fetcher = fetcher
        self._trainer = trainer
        self._run_id = cfg.run.run_id
        self.dir = directory
        self._pending: dict[int, StepRecord] = {}
        self._heard = asyncio.Event()
        self.plan = WindowPlan(cfg.validator.audit_fraction, draw or random.SystemRandom().random)
        self._next = 0  # the record the window in progress takes next (0: no window in progress)
        self._waiting_since: float | None = None
        self._replay: WindowReplay | None = None
        self._window: dict[str, int] = {}  # the window in progress: start version and seq, steps passed
        self._settings = run_settings(cfg)
        self._rescorer = run_rescorer(cfg, StatusBoard(role="auditor"))
        self.counts = {"audited": 0, "pass": 0, "fail": 0, "unavailable": 0}
        self.windows = {"audited": 0, "pass": 0, "fail": 0, "unavailable": 0}
        self.first_bad: dict[str, object] = {}
        self.last: dict[str, object] = {}
        self._last_window = ""  # the outcome of the last window that ended
        self._validators = frozenset(cfg.run.validator_peer_ids)
        self.admission = AdmissionCheck(RunRules(self._run_id, self._validators, cfg.run.verdict_quorum,
                                                 cfg.run.async_level))
        self.drops = DropCheck(trainer_refusal(self._rescorer), cfg.run.async_level)
        self._newest_version = 0  # the newest policy version a record heard made
        self.tolerance = cfg.run.audit_tolerance
        self.published = PublishedPolicy(fetcher, trainer, directory / "published")
        self._sizes: StateSizes | None = None  # run() sets it from the model it loads
        self._published_of: PublishedOf | None = None  # run() sets both when the tolerance is not 0
        self._optimizer_of: OptimizerOf | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._swarm.subscribe(topic(self._run_id, STEP_KIND), record_validator(self._run_id, self._trainer),
                              self._on_record)
        self._swarm.subscribe(topic(self._run_id, VERDICT_KIND),
                              verdict_validator(self._run_id, self._validators), self._on_verdict,
                              include_own=True)

    def announced(self, ann: PolicyAnnouncement) -> None:
        """Every policy announcement of the run's trainer the node hears (checked and signed): the deltas
        and full weights a replay within the tolerance may need (``published.py``)."""
        self.published.heard(ann)

    def status(self) -> dict[str, object]:
        if self._next:
            state = "following"  # a window in progress
        else:
            state = "stopped" if self._last_window in ("fail", "unavailable") else "waiting"
        return {**self.counts, "windows": {**self.windows, "skipped": self.plan.skipped},
                "fraction": self.plan.fraction, "window": dict(self._window), "next_seq": self._next,
                "held": len(self._pending), "first_bad": dict(self.first_bad), "last": dict(self.last),
                "disputed": self.admission.disputed, "drops_checked": self.drops.checked, "state": state,
                "tolerance": self.tolerance,
                "published_fetched": dict(self.published.fetched)}

    def _on_verdict(self, msg: tuple[BatchVerdict, str], origin: str) -> None:
        self.admission.heard(msg[0], msg[1], self._newest_version, at=time.monotonic())

    async def _on_record(self, rec: StepRecord, origin: str) -> None:
        self._newest_version = max(self._newest_version, rec.version)
        self.admission.named(rec)  # every record heard, audited or not: what it names was not dropped
        self.drops.named(rec)
        if rec.seq >= max(self._next, self.plan.position) and len(self._pending) < MAX_PENDING:
            self._pending.setdefault(rec.seq, rec)
            self._heard.set()

    async def _wait_heard(self) -> None:
        self._heard.clear()
        try:
            await asyncio.wait_for(self._heard.wait(), 5.0)
        except asyncio.TimeoutError:
            pass

    async def run(self) -> None:
        """The audit loop (one of the validator's loops)."""
        import torch

        from intellect_node.trainer.model import TrainOptions, load_trainable

        torch.set_num_threads(1)  # as the trainer: bitwise replays need the same thread count
        if self.tolerance > 0:  # the replay (a worker thread) asks for published weights while it runs
            self._published_of, self._optimizer_of = self.published.blocking(asyncio.get_running_loop())
        model = await asyncio.to_thread(load_trainable, model_dir(self._cfg),
                                        TrainOptions.from_section(self._cfg.rl))
        self._sizes = self.published.sizes = StateSizes.of(model)
        while True:
            if not self._next:
                self.plan.prune(self._pending)
                start = self.plan.next_start(self._pending)
                if start is None:
                    await self._wait_heard()
                else:
                    await self._open(model, start)
                continue
            rec = self._pending.pop(self._next, None)
            if rec is None:
                await self._missing()
                continue
            self._waiting_since = None
            await self._audit(rec)

    async def _open(self, model: torch.nn.Module, start: Start) -> None:
        """Begin the window ``start`` (its start state fetched and loaded; a window whose start cannot be
        had ends here, with its verdict)."""
        self._window = {"start_version": start.version, "first_seq": start.first, "passed": 0}
        rec = start.record
        if rec is None:  # version 0: the model as loaded holds it (checked against the first record)
            self._replay = WindowReplay(model, self._settings, tolerance=self.tolerance,
                                        published=self._published_of)
            self._next = start.first
            return
        assert rec.state is not None and self._sizes is not None
        sizes = self._sizes
        try:
            weights = await self._fetch_start(rec.state.weights_cid, max_size=sizes.weights,
                                              size=sizes.weights)
            optimizer = await self._fetch_start(rec.state.optimizer_cid, max_size=sizes.optimizer)
        except WrongSize as exc:  # the manifest is what the CID the trainer signed names: its doing
            reason = f"{START_REASON} v{rec.version}: {exc} by the run's model"
            self._swarm.peerbook.record_rejection(self._trainer, reason)
            await self._start_failed(rec, "fail", reason)
            return
        except ProtocolError as exc:  # fetched whole, and not a canonical tensor file
            await self._start_failed(rec, "fail", f"{START_REASON} v{rec.version}: {exc}")
            return
        except (IntellectNodeError, OSError, asyncio.TimeoutError) as exc:  # OSError: this node's disk
            await self._start_failed(rec, "unavailable", f"{START_REASON} v{rec.version} not fetched: {exc}")
            return
        try:
            self._replay = await asyncio.to_thread(load_start, model, rec, weights, optimizer, self._settings,
                                                   tolerance=self.tolerance, published=self._published_of)
        except ProtocolError as exc:
            await self._start_failed(rec, "fail", f"{START_REASON} v{rec.version}: {exc}")
            return
        self._next = start.first

    async def _fetch_start(self, cid: str, *, max_size: int, size: int | None = None) -> PolicyWeights:
        """A start blob, fetched into a file under the auditor's directory and mapped (never read)."""
        return await fetch_mapped(self._fetcher, cid, self.dir / "start" / f"{cid}.safetensors",
                                  holders=[self._trainer], max_size=max_size, size=size,
                                  timeout=START_FETCH_TIMEOUT_S)

    async def _start_failed(self, rec: StepRecord, outcome: Outcome, reason: str) -> None:
        assert rec.state is not None
        log.warning("audit window from v%d: %s: %s", rec.version, outcome, reason)
        await self._verdict(StepAudit(rec.seq, rec.version, outcome, rec.state.optimizer_hash, reason=reason),
                            step=False)
        self._end_window(outcome, rec.seq)

    async def _missing(self) -> None:
        """The window's next record is not held: wait for it, or end the window when later ones are held
        and it stayed unheard for :data:`RECORD_WAIT_S`."""
        if self._pending and self._waiting_since is None:
            self._waiting_since = time.monotonic()
        if self._waiting_since is not None and time.monotonic() - self._waiting_since > RECORD_WAIT_S:
            self.counts["unavailable"] += 1
            entry: dict[str, object] = {"seq": self._next, "outcome": "unavailable",
                                        "reason": "step record never heard"}
            if not self.first_bad:
                self.first_bad = entry
            await asyncio.to_thread(append_jsonl, self.dir / VERDICTS_FILE, {**entry, "time": time.time()})
            self._waiting_since = None
            self._end_window("unavailable", self._next)
            return
        await self._wait_heard()

    async def _audit(self, rec: StepRecord) -> None:
        replay = self._replay
        assert replay is not None, "a window in progress has its replay"
        why = self.admission.check(rec)  # no replay for a step that should not have taken its batches
        dropped: tuple[Outcome, str] = ("pass", "") if why else await self.drops.check(rec, self._fetch_batch)
        if why:
            result = StepAudit(rec.seq, rec.version, "fail", rec.checkpoint_hash, reason=why)
        elif dropped[0] != "pass":  # nor for one whose drops do not hold (or could not be checked)
            result = StepAudit(rec.seq, rec.version, dropped[0], rec.checkpoint_hash, reason=dropped[1])
        else:
            data = await self._fetch_all(rec)
            groups = batch_groups(self._rescorer, data.get)

            def audit() -> StepAudit:
                return check_end(replay, rec, replay.audit(rec, groups), self._optimizer_of)

            result = await asyncio.to_thread(audit)
        await self._verdict(result, step=True)
        if result.outcome != "pass":
            self._end_window(result.outcome, rec.seq)
            return
        self._window["passed"] += 1
        self._next = rec.seq + 1
        if rec.state is not None:  # the window's end: the next is drawn here
            self._end_window("pass", rec.seq)
            if self.plan.goes_on(rec):
                self._window = {"start_version": rec.version, "first_seq": rec.seq + 1, "passed": 0}
                self._next = rec.seq + 1

    def _end_window(self, outcome: Outcome, seq: int) -> None:
        self.windows["audited"] += 1
        self.windows[outcome] += 1
        self._last_window = outcome
        self.plan.ended(seq)
        self._next = 0
        self._window = {}
        for s in [s for s in self._pending if s <= seq]:
            del self._pending[s]

    async def _fetch_all(self, rec: StepRecord) -> dict[str, bytes]:
        """The bytes of every batch ``rec`` took (not the stale ones) that can be had (the others are left
        out: the audit reports them ``unavailable``)."""
        out: dict[str, bytes] = {}

        async def one(b: StepBatch) -> None:
            if (data := await self._fetch_batch(b.cid, b.worker)) is not None:
                out[b.cid] = data

        await asyncio.gather(*(one(b) for b in rec.batches))  # all: the filter's choice is checked too
        return out

    async def _fetch_batch(self, cid: str, worker: str) -> bytes | None:
        """A batch's bytes from its worker or the trainer; None (logged) when they cannot be had."""
        try:
            return await self._fetcher.fetch(cid, holders=[worker, self._trainer], max_size=MAX_BATCH_SIZE,
                                             timeout=FETCH_TIMEOUT_S)
        except (IntellectNodeError, asyncio.TimeoutError) as exc:
            log.warning("audit: batch %s of worker %s not fetched: %s", cid, worker, exc)
            return None

    async def _verdict(self, r: StepAudit, *, step: bool) -> None:
        if step:
            self.counts["audited"] += 1
            self.counts[r.outcome] += 1
        entry: dict[str, object] = {
            "seq": r.seq, "version": r.version, "outcome": r.outcome, "published": r.published,
            "expected": r.expected, "reason": r.reason, "time": time.time(),
            "window": self._window.get("start_version", r.version) if step else r.version}
        self.last = entry
        if r.outcome != "pass" and not self.first_bad:
            self.first_bad = entry
            log.warning("audit of step %d (v%d): %s: %s", r.seq, r.version, r.outcome, r.reason)
        await asyncio.to_thread(append_jsonl, self.dir / VERDICTS_FILE, entry)
        v = AuditVerdict(run_id=self._run_id, trainer=self._trainer, seq=r.seq, version=r.version,
                         outcome=r.outcome, published=r.published, expected=r.expected,
                         reason=r.reason[:1024])
        await self._swarm.publish(topic(self._run_id, AUDIT_KIND), seal_verdict(self._swarm.key, v))
