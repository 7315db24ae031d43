"""The chain auditor: a validator that replays every training step from the trainer's signed records.

With ``validator.audit`` on, a validator runs a :class:`ChainAuditor` beside its checks. It hears the
step records on the run's ``steps`` topic, keeps them by journal sequence number, and takes them in
order from the first: for each, it checks the evidence that admitted its batches and that no batch the
validators accepted was dropped without a word (``evidence.py``, from the verdicts it hears on the run's
``verdicts`` topic, its own included), then fetches the batches the record names through the swarm (from their
workers or the trainer), re-scores them as the trainer does (``inputs.py``) and replays the step on its
own copy of the model (``replay.py``: :class:`~intellect_node.roles.auditor.replay.WindowReplay`, the CPU
with one torch thread). It signs an ``AuditVerdict`` per record (``protocol/audits.py``), gossips it on
the run's ``audits`` topic, appends it to ``auditor/verdicts.jsonl`` and reports the audit state in its
status (``audit``: audited, passed, failed, unavailable, the first step that did not pass).

Shortcuts: it replays every step from version 0 (the trainer does not publish its optimizer state, so a
window cannot start later, and steps cannot be picked at random); it stops at the first step that does
not pass (its weights no longer follow the published chain) and at a missing record (a sequence number
not heard within :data:`RECORD_WAIT_S` is reported ``unavailable``). Nothing acts on its verdicts yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from intellect_node.config.schema import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.errors import IntellectNodeError
from intellect_node.fsutil import append_jsonl
from intellect_node.protocol.audits import AUDIT_KIND, AuditVerdict, seal_verdict
from intellect_node.protocol.rl import VERDICT_KIND, BatchVerdict, verdict_validator
from intellect_node.protocol.rollout import MAX_BATCH_SIZE
from intellect_node.protocol.steps import STEP_KIND, StepBatch, StepRecord, record_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.auditor.evidence import AdmissionCheck, RunRules
from intellect_node.roles.auditor.inputs import batch_groups, run_rescorer, run_settings
from intellect_node.roles.auditor.replay import StepAudit, WindowReplay
from intellect_node.roles.common.fetch import HintedFetcher
from intellect_node.roles.common.models import model_dir
from intellect_node.roles.common.seams import RoleSwarm

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Records held ahead of the one being audited; more are dropped (heard again later or reported missing)."""
RECORD_WAIT_S = 300.0
"""Seconds the next record may stay unheard while later ones are held before it is reported missing."""
FETCH_TIMEOUT_S = 60.0
VERDICTS_FILE = "verdicts.jsonl"


class ChainAuditor:
    """Audits the run's steps in order (see the module docstring); ``start`` subscribes, ``run`` loops."""

    def __init__(self, cfg: NodeConfig, *, swarm: RoleSwarm, fetcher: HintedFetcher, trainer: str,
                 directory: Path) -> None:
        self._cfg = cfg
        self._swarm = swarm
        self._fetcher = fetcher
        self._trainer = trainer
        self._run_id = cfg.run.run_id
        self.dir = directory
        self._pending: dict[int, StepRecord] = {}
        self._heard = asyncio.Event()
        self._next = 1
        self._waiting_since: float | None = None
        self._replay: WindowReplay | None = None
        self._rescorer = run_rescorer(cfg, StatusBoard(role="auditor"))
        self._validators = frozenset(cfg.run.validator_peer_ids)
        self.admission = AdmissionCheck(RunRules(self._run_id, self._validators, cfg.run.verdict_quorum,
                                                 cfg.run.async_level))
        self._newest_version = 0  # the newest policy version a record heard made
        self.counts = {"audited": 0, "pass": 0, "fail": 0, "unavailable": 0}
        self.first_bad: dict[str, Any] = {}
        self.last: dict[str, Any] = {}

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._swarm.subscribe(topic(self._run_id, STEP_KIND), record_validator(self._run_id, self._trainer),
                              self._on_record)
        self._swarm.subscribe(topic(self._run_id, VERDICT_KIND),
                              verdict_validator(self._run_id, self._validators), self._on_verdict,
                              include_own=True)

    def status(self) -> dict[str, Any]:
        return {**self.counts, "next_seq": self._next, "held": len(self._pending),
                "first_bad": dict(self.first_bad), "last": dict(self.last),
                "disputed": self.admission.disputed,
                "state": ("stopped" if self._replay is not None and self._replay.stopped else "following")}

    def _on_verdict(self, msg: tuple[BatchVerdict, str], origin: str) -> None:
        self.admission.heard(msg[0], msg[1], self._newest_version)

    async def _on_record(self, rec: StepRecord, origin: str) -> None:
        self._newest_version = max(self._newest_version, rec.version)
        if rec.seq >= self._next and len(self._pending) < MAX_PENDING:
            self._pending.setdefault(rec.seq, rec)
            self._heard.set()

    async def run(self) -> None:
        """The audit loop (one of the validator's loops)."""
        import torch

        from intellect_node.trainer.model import TrainOptions, load_trainable

        torch.set_num_threads(1)  # as the trainer: bitwise replays need the same thread count
        model = await asyncio.to_thread(load_trainable, model_dir(self._cfg),
                                        TrainOptions.from_section(self._cfg.rl))
        self._replay = replay = WindowReplay(model, run_settings(self._cfg))
        while not replay.stopped:
            rec = self._pending.pop(self._next, None)
            if rec is None:
                if self._pending and self._waiting_since is None:
                    self._waiting_since = time.monotonic()
                if self._waiting_since is not None and time.monotonic() - self._waiting_since > RECORD_WAIT_S:
                    replay.stopped = f"step record {self._next} never heard"
                    self._report_missing()
                    break
                self._heard.clear()
                try:
                    await asyncio.wait_for(self._heard.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
                continue
            self._waiting_since = None
            why = self.admission.check(rec)  # no replay for a step that should not have taken its batches
            if why:
                result = StepAudit(rec.seq, rec.version, "fail", rec.checkpoint_hash, reason=why)
                replay.stopped = f"after step {rec.seq} (fail)"
            else:
                data = await self._fetch_all(rec)
                result = await asyncio.to_thread(replay.audit, rec, batch_groups(self._rescorer, data.get))
            await self._verdict(result)
            self._next += 1
        log.warning("audit stopped: %s", replay.stopped)

    async def _fetch_all(self, rec: StepRecord) -> dict[str, bytes]:
        """The bytes of every batch ``rec`` took (not the stale ones) that can be had (the others are left
        out: the audit reports them ``unavailable``)."""
        out: dict[str, bytes] = {}

        async def one(b: StepBatch) -> None:
            try:
                out[b.cid] = await self._fetcher.fetch(b.cid, holders=[b.worker, self._trainer],
                                                       max_size=MAX_BATCH_SIZE, timeout=FETCH_TIMEOUT_S)
            except (IntellectNodeError, asyncio.TimeoutError) as exc:
                log.warning("audit of step %d: batch %s not fetched: %s", rec.seq, b.cid, exc)

        await asyncio.gather(*(one(b) for b in rec.batches))  # all: the filter's choice is checked too
        return out

    def _report_missing(self) -> None:
        self.counts["unavailable"] += 1
        self.first_bad = {"seq": self._next, "outcome": "unavailable", "reason": "step record never heard"}

    async def _verdict(self, r: StepAudit) -> None:
        self.counts["audited"] += 1
        self.counts[r.outcome] += 1
        entry = {"seq": r.seq, "version": r.version, "outcome": r.outcome, "published": r.published,
                 "expected": r.expected, "reason": r.reason, "time": time.time()}
        self.last = entry
        if r.outcome != "pass" and not self.first_bad:
            self.first_bad = entry
            log.warning("audit of step %d (v%d): %s: %s", r.seq, r.version, r.outcome, r.reason)
        await asyncio.to_thread(append_jsonl, self.dir / VERDICTS_FILE, entry)
        v = AuditVerdict(run_id=self._run_id, trainer=self._trainer, seq=r.seq, version=r.version,
                         outcome=r.outcome, published=r.published, expected=r.expected,
                         reason=r.reason[:1024])
        await self._swarm.publish(topic(self._run_id, AUDIT_KIND), seal_verdict(self._swarm.key, v))
