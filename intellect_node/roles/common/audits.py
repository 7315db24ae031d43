"""What every node of a run makes of the auditors' verdicts: :class:`AuditWatch`.

Auditors (validators with ``validator.audit``, ``roles/auditor/chain.py``) sign one ``AuditVerdict`` per
step record of the trainer (``protocol/audits.py``) on the run's ``audits`` topic. Every joined node
(worker, validator, trainer, a node with no role) runs an :class:`AuditWatch` (a common service,
``node/assembly.py``) that:

1. accepts verdicts only from the run's auditors: ``run.validator_peer_ids`` and ``run.auditor_peer_ids``,
   about the run's trainer (``run.trainer_peer_id``), of this run, published by the auditor that signed
   them; anything else is refused in the gossip validator and the reason recorded against the peer that
   sent it, as on every topic. A verdict sealed outside the window (``protocol.audits``: 5 minutes old,
   1 minute ahead) or one whose signed bytes were taken before is ignored there (``MessageIgnored``:
   not forwarded, blamed on no one; counted in ``ignored_verdicts``): a replay is not its signer's
   doing. A node whose run names no trainer or no auditor subscribes to nothing and reads
   ``unaudited``, with why;
2. counts them per step in an :class:`AuditTally` (a pure state machine): a step is ``failed`` if any
   auditor failed it, else ``passed`` if any passed it, else ``unavailable``; ``unavailable`` is never
   counted as a pass, and a run with no verdict heard reads ``unaudited``, not passing;
3. keeps the evidence of each failed step before acting on it: ``<data-dir>/audits/<run>/evidence/
   <seq>.verdict`` (the signed envelope as received) and ``<seq>.json`` (run, trainer, auditor, seq,
   version, expected and published hashes, reason), both written atomically, the JSON last;
4. publishes the state on the status board (``snapshot.audits``: ``status``, the dashboard, ``/metrics``)
   and under ``audits`` in ``GET /v1/status``;
5. with ``run.require_audits`` on, refuses the trainer from its first failed step on: :meth:`refusal`
   is the reason (``""`` while following), which the worker (no more generation or submissions), the
   validator (no more verification) and :class:`~intellect_node.roles.common.follow.TrainerPolicy` (no
   newer policy adopted) consult; the node reads ``degraded`` with that reason and logs it as an error.
   At start the evidence kept is read back (each envelope checked again against the run's auditors and
   trainer), so a restarted node still refuses that trainer. With it off a failed audit is shown (state
   ``failed``, a warning) and nothing stops.

6. runs a :class:`~intellect_node.roles.common.binding.BindingWatch`: every announcement and step record
   of the trainer heard, checked for two hashes signed for one version (an announced policy other than
   the one the records describe, which no replay would see). Such a pair is a failed audit found by the
   node itself, or a proof heard on the run's ``conflicts`` topic and checked here before it counts; it
   is kept in the same evidence folder (``v<version>.conflict``) and refuses the trainer as a failed step
   does;

7. measures the run's audit coverage (:class:`Coverage`, ``run.audit_checkpoint_every``): from the step
   records the binding watch hears, the trained steps since the newest one carrying ``state``, and from
   the verdicts, the window starts the auditors could not fetch. Too little is a warning (logged when it
   turns low, at most every :data:`COVERAGE_WARN_S` after), shown beside the audit state; with
   ``run.require_audits`` it is a refusal of its own (``audit coverage too low: ...``, the node's
   degraded part ``audit coverage``), lifted once coverage is back: no evidence, nothing final.

Bounds (a trusted auditor's key may still be stolen): a verdict is at most ``MAX_AUDIT_BYTES``; each
auditor's verdicts are remembered for its latest :data:`MAX_PER_AUDITOR` steps, the tally's steps for the
latest :data:`MAX_STEPS` (older steps stay in the counts, and a verdict about one of them is ignored);
at most :data:`MAX_EVIDENCE` failed steps are kept as evidence (the first ones: what a refusal rests on),
and each auditor's first :data:`MAX_FAILS_PER_AUDITOR` failing verdicts count towards the quorum and are
kept (one stolen key cannot crowd out the others' evidence).
An auditor that contradicts itself about a step (a pass and a fail: two different verdicts it signed,
never one repeated) is refused and the contradiction recorded against it (an auditor of the run is never
banned for it by count, ``p2p/peerbook.py``); ``unavailable`` may later turn into a pass or a fail, and
an ``unavailable`` heard after the step's pass or fail is an older word, superseded, ignored.

Shortcuts: the counts other than the evidence live in memory (a restarted node counts afresh from the
verdicts it hears, with its failed steps read back from the evidence). A replay's failure cannot be
checked by a follower (it would have to replay the step), so ``run.audit_quorum`` auditors (distinct
keys) must fail one step before the node refuses the trainer; the default 1 keeps one auditor's failure
enough (auditors are configured, like the validators whose single rejection refuses a batch). Below the
quorum a failed step is shown (state ``failed``, ``failed_by`` in the status) and the trainer followed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from intellect_node.config.status import AuditFailure, Audits, clean_text
from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.fsutil import atomic_write_bytes, atomic_write_text
from intellect_node.protocol import codec
from intellect_node.protocol.audits import (
    AUDIT_KIND,
    MAX_AUDIT_BYTES,
    AuditVerdict,
    open_verdict,
    verdict_validator,
)
from intellect_node.protocol.freshness import SeenDigests
from intellect_node.protocol.steps import StepRecord
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.binding import BindingWatch, Proof
from intellect_node.roles.common.pins import GC_MIN_AGE_S, PINNED_STATES
from intellect_node.roles.common.seams import Runtime

log = logging.getLogger(__name__)

MAX_STEPS = 65536
"""Steps whose outcome the tally holds (a few MB); older ones stay in the counts only."""
MAX_PER_AUDITOR = 4096
"""Steps each auditor's own verdicts are remembered for (repeats ignored, contradictions refused)."""
MAX_EVIDENCE = 64
"""Failed steps kept as evidence in the data dir (the first ones heard)."""
MAX_FAILS_PER_AUDITOR = 16
"""Failing verdicts of one auditor counted towards ``run.audit_quorum`` and kept (its first ones): an
honest auditor ends its window at a failure, so one stolen key cannot crowd out the others' evidence."""
REASON_CHARS = 300
"""An auditor's reason as the status shows it (the evidence file keeps it whole: at most 1024)."""
EVIDENCE_DIR = "evidence"
RANK = {"unavailable": 0, "pass": 1, "fail": 2}
"""A step's outcome over its auditors is the highest ranked one said of it."""
COUNTED = {"pass": "passed", "fail": "failed", "unavailable": "unavailable"}


COVERAGE_GRACE_STEPS = 2
"""Trained steps a gap may run past ``run.audit_checkpoint_every`` before coverage reads low: records heard
out of order (gossip may deliver the step after a checkpoint before the checkpoint's own record, whose
state blobs the trainer stores first) or still in flight."""
START_STREAK = 3
"""Window starts in a row the auditors could not fetch, with no step passed after them, that make
coverage low."""
START_REASON = "window start"
"""How an auditor's verdict about a window's start begins (``roles/auditor/chain.py``): the verdict names
the record whose state it is."""
MAX_STARTS = 64
"""Starts not fetched the coverage remembers (the newest)."""
SERVED_S = GC_MIN_AGE_S / 2
"""How long after its record was heard a start still counts against the trainer when it cannot be
fetched (beside the newest pinned ones): half the hour every blob is kept, from when the trainer stored
it, a little before its record went out."""
MARK_S = 60.0
"""The coverage notes the highest record heard once a minute: when a start was heard, to a minute."""
COVERAGE_WARN_S = 600.0
"""While coverage stays low its warning is logged again at most this often (on a change)."""


class Coverage:
    """Whether the run's trainer keeps its steps auditable (``run.audit_checkpoint_every``; a pure state
    machine, ``now`` handed in): from its step records, the trained steps since the newest one carrying
    ``state`` (the gap), and from the auditors' verdicts, the window starts they could not fetch.

    Coverage is ``low`` when the gap exceeds ``every`` + :data:`COVERAGE_GRACE_STEPS`, or when the
    auditors could not fetch :data:`START_STREAK` starts in a row (no step passed after any of them). A
    node that joins late (or restarts) measures the gap from the first record it hears, so it never
    blames the trainer for what it did not see. A start counts only while the trainer must still serve
    it: one of the newest :data:`PINNED_STATES` starts heard, or heard less than :data:`SERVED_S` ago
    (an auditor far behind asks for blobs an honest trainer has let go). ``every`` 0: no rule (``off``),
    the gap still measured. Memory is bounded: the newest starts, a mark a minute over that time, the
    newest :data:`MAX_STARTS` starts not fetched."""

    def __init__(self, every: int, *, grace: int = COVERAGE_GRACE_STEPS, streak: int = START_STREAK,
                 served_s: float = SERVED_S, pinned: int = PINNED_STATES) -> None:
        self.every = every
        self._grace = grace
        self._streak = streak
        self._served_s = served_s
        self._pinned = pinned
        self.top = -1  # the highest trained step a record heard reached (-1: none heard)
        self._first = -1  # the lowest step heard
        self.state_step = -1  # the highest step of a record heard carrying state
        self._starts: list[int] = []  # the newest ``pinned`` seqs of records heard carrying state
        self._marks: list[tuple[float, int]] = []  # (when, the highest seq heard by a minute after)
        self._let_go = 0  # every seq up to it was heard more than served_s ago
        self.unfetched: dict[int, str] = {}  # seq of a start not fetched (none passed after it) -> why
        self._passed = 0  # the highest step seq a verdict passed

    def record(self, rec: StepRecord, now: float) -> None:
        """A step record of the trainer, heard (checked by the caller)."""
        self.top = max(self.top, rec.step)
        self._first = rec.step if self._first < 0 else min(self._first, rec.step)
        if not self._marks or now - self._marks[-1][0] >= MARK_S:
            self._marks.append((now, rec.seq))
        elif rec.seq > self._marks[-1][1]:  # dated by the minute's start: older, never younger
            self._marks[-1] = (self._marks[-1][0], rec.seq)
        self._age(now)
        if rec.state is not None:
            self.state_step = max(self.state_step, rec.step)
            if rec.seq not in self._starts:
                self._starts = sorted([*self._starts, rec.seq])[-self._pinned:]

    def _age(self, now: float) -> None:
        while self._marks and now - self._marks[0][0] >= self._served_s:
            self._let_go = max(self._let_go, self._marks.pop(0)[1])

    def verdict(self, v: AuditVerdict, now: float) -> None:
        """An auditor's verdict, taken (checked and counted by the caller)."""
        if v.outcome == "pass" and v.seq > self._passed:
            self._passed = v.seq  # a step after these starts was replayed: they are covered
            self.unfetched = {s: why for s, why in self.unfetched.items() if s >= v.seq}
        elif v.outcome == "unavailable" and v.reason.startswith(START_REASON) and v.seq >= self._passed \
                and self._served(v.seq, now):
            self.unfetched.setdefault(v.seq, v.reason)
            while len(self.unfetched) > MAX_STARTS:
                del self.unfetched[min(self.unfetched)]

    def _served(self, seq: int, now: float) -> bool:
        """Whether the trainer must still serve the start of record ``seq``: one of the newest pinned, or
        heard here less than ``served_s`` ago (or not heard here yet)."""
        self._age(now)
        return seq in self._starts or seq > self._let_go

    @property
    def gap(self) -> int:
        """Trained steps heard since the newest start heard (version 0, or where this node began)."""
        if self.top < 0:
            return 0
        return self.top - max(self.state_step, self._first - 1, 0)

    @property
    def low(self) -> str:
        """Why coverage is too low ("" while it is not, or with no rule)."""
        if not self.every:
            return ""
        if self.gap > self.every + self._grace:
            since = max(self.state_step, self._first - 1, 0)
            return (f"{self.gap} trained steps without a checkpoint state (the newest heard: step {since}); "
                    f"run.audit_checkpoint_every is {self.every}")
        if len(self.unfetched) >= self._streak:
            seq = max(self.unfetched)
            return (f"the auditors could not fetch the last {len(self.unfetched)} window starts (the "
                    f"newest: step record {seq}: {clean_text(self.unfetched[seq], REASON_CHARS)})")
        return ""

    @property
    def state(self) -> str:
        return "off" if not self.every else "low" if self.low else "ok"


@dataclass(frozen=True)
class Evidence:
    """A failed step's evidence: the verdict, who signed it and the envelope as received."""

    verdict: AuditVerdict
    auditor: str
    envelope: bytes
    received_at: float

    def to_json(self) -> str:
        v = self.verdict
        return json.dumps({"run_id": v.run_id, "trainer": v.trainer, "auditor": self.auditor, "seq": v.seq,
                           "version": v.version, "outcome": v.outcome, "expected": v.expected,
                           "published": v.published, "reason": v.reason, "received_at": self.received_at,
                           "envelope": f"{v.seq}.verdict"}, indent=1, sort_keys=True)

    def failure(self) -> AuditFailure:
        v = self.verdict
        return AuditFailure(seq=v.seq, version=v.version, auditor=self.auditor, expected=v.expected,
                            published=v.published, reason=clean_text(v.reason, REASON_CHARS),
                            ts=self.received_at)


class AuditTally:
    """The verdicts about one trainer's steps, per step (no I/O: see the module docstring)."""

    def __init__(self, trainer: str, *, max_steps: int = MAX_STEPS, max_per_auditor: int = MAX_PER_AUDITOR
                 ) -> None:
        self.trainer = trainer
        self._max_steps = max_steps
        self._max_per_auditor = max_per_auditor
        self._steps: dict[int, str] = {}  # seq -> the step's outcome over its auditors
        self._floor = 0  # steps at or below it were let go: verdicts about them are ignored
        self._by_auditor: dict[str, OrderedDict[int, str]] = {}
        self.counts = {"passed": 0, "failed": 0, "unavailable": 0}
        self.first_failed: Evidence | None = None
        self.last_at = 0.0

    @property
    def audited(self) -> int:
        return sum(self.counts.values())

    @property
    def heard_from(self) -> int:
        return len(self._by_auditor)

    def add(self, v: AuditVerdict, auditor: str) -> bool:
        """Count ``v`` (signed by ``auditor``, checked by the caller); True when it changed a step's
        outcome, False for a repeat or a step let go. ProtocolError for a verdict about another trainer
        or one that contradicts the auditor's earlier verdict about the step."""
        if v.trainer != self.trainer:
            raise ProtocolError(f"audit verdict about trainer {v.trainer[:64]!r}, the run's is "
                                f"{self.trainer}")
        if v.seq <= self._floor:
            return False
        mine = self._by_auditor.setdefault(auditor, OrderedDict())
        said = mine.get(v.seq)
        if said == v.outcome or (said is not None and v.outcome == "unavailable"):
            return False  # a repeat, or the word before this auditor's pass or fail
        if said is not None and said != "unavailable":
            raise ProtocolError(f"audit verdict {v.outcome} on step {v.seq} contradicts the {said} "
                                "this auditor signed before")
        mine[v.seq] = v.outcome
        mine.move_to_end(v.seq)
        while len(mine) > self._max_per_auditor:
            mine.popitem(last=False)
        before = self._steps.get(v.seq)
        if before is not None and RANK[before] >= RANK[v.outcome]:
            return False
        if before is not None:
            self.counts[COUNTED[before]] -= 1
        self._steps[v.seq] = v.outcome
        self.counts[COUNTED[v.outcome]] += 1
        while len(self._steps) > self._max_steps:
            oldest = min(self._steps)
            del self._steps[oldest]
            self._floor = max(self._floor, oldest)
        return True

    def failed(self, ev: Evidence) -> None:
        """``ev`` is a failed step (added first): the earliest one by sequence number is the run's
        ``first_failed``."""
        if self.first_failed is None or ev.verdict.seq < self.first_failed.verdict.seq:
            self.first_failed = ev

    @property
    def state(self) -> str:
        if self.counts["failed"] or self.first_failed is not None:
            return "failed"
        if self.counts["unavailable"]:
            return "partial"
        return "passing" if self.counts["passed"] else "unaudited"


def evidence_dir(data_dir: Path, run_id: str) -> Path:
    return Path(data_dir) / "audits" / run_id / EVIDENCE_DIR


def write_evidence(directory: Path, ev: Evidence, name: str = "") -> Path:
    """Keep ``ev`` as ``name`` (default: its step's number; another auditor's failure of the same step:
    ``<seq>-<k>``): the envelope first, then the JSON that names it, each written atomically; the JSON's
    path."""
    name = name or str(ev.verdict.seq)
    atomic_write_bytes(directory / f"{name}.verdict", ev.envelope)
    path = directory / f"{name}.json"
    atomic_write_text(path, ev.to_json())
    return path


def read_evidence(directory: Path, *, run_id: str, trainer: str, auditors: frozenset[str]
                  ) -> tuple[list[Evidence], list[str]]:
    """The evidence kept in ``directory`` that still holds: each envelope opened and checked again (run,
    auditors, trainer, a failure); ``(evidence, why each other file was left out)``."""
    found: list[Evidence] = []
    skipped: list[str] = []
    if not directory.is_dir():
        return found, skipped
    limit = MAX_EVIDENCE + MAX_FAILS_PER_AUDITOR * len(auditors)
    for path in sorted(directory.glob("[0-9]*.json"))[:limit]:  # v*.json: hash conflicts
        raw = path.with_suffix(".verdict")
        try:
            doc = json.loads(path.read_text())
            data = raw.read_bytes()[:MAX_AUDIT_BYTES + 1024]
            v, signer = open_verdict(data, run_id=run_id, auditors=auditors)
        except (OSError, ValueError, ProtocolError) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        if v.trainer != trainer or v.outcome != "fail":
            skipped.append(f"{path.name}: a {v.outcome} about trainer {v.trainer}, the run's is {trainer}")
            continue
        at = doc.get("received_at") if isinstance(doc, dict) else None
        found.append(Evidence(v, signer, data, float(at) if isinstance(at, (int, float)) else 0.0))
    return found, skipped


class AuditWatch:
    """The run's audit state on this node (a common service; see the module docstring)."""

    name = "audits"

    def __init__(self, runtime: Runtime) -> None:
        cfg = runtime.config
        self._rt = runtime
        self.run_id = cfg.run.run_id
        self.trainer = cfg.run.trainer_peer_id or ""
        self.auditors = frozenset(cfg.run.validator_peer_ids) | frozenset(cfg.run.auditor_peer_ids)
        self.required = cfg.run.require_audits
        self.quorum = cfg.run.audit_quorum
        self.dir = evidence_dir(runtime.data_dir, self.run_id)
        self._fails: dict[int, dict[str, Evidence]] = {}  # seq -> auditor -> its failing verdict
        self.tally = AuditTally(self.trainer)
        self.evidence: dict[int, Path] = {}  # seq -> evidence JSON kept
        self.refused = {"verdicts": 0}  # verdicts refused after the gossip validator (contradictions)
        self.ignored = {"stale": 0, "repeat": 0}  # verdicts the gossip validator ignored (MessageIgnored)
        self._open = verdict_validator(self.run_id, self.auditors)
        self._seen = SeenDigests()  # the signed verdicts taken (the gossip validator's, trio thread)
        self._refusal = ""
        self._lock = asyncio.Lock()  # one verdict counted (and its evidence kept) at a time
        self.detail = ("" if self.trainer and self.auditors else
                       "the run names no trainer (run.trainer_peer_id)" if not self.trainer else
                       "the run names no auditor (run.validator_peer_ids, run.auditor_peer_ids)")
        self.binding = BindingWatch(runtime, self.dir, self.trainer, self._proven, on_record=self._record)
        self.coverage = Coverage(cfg.run.audit_every)
        self._coverage_refusal = ""
        self._coverage_low = ""  # the reason last logged
        self._coverage_warned = -COVERAGE_WARN_S  # monotonic time of the last warning

    @classmethod
    def for_runtime(cls, runtime: Runtime) -> "AuditWatch":
        return cls(runtime)

    async def start(self) -> None:
        if self.detail:
            self._publish()
            return
        found, skipped = await asyncio.to_thread(read_evidence, self.dir, run_id=self.run_id,
                                                 trainer=self.trainer, auditors=self.auditors)
        for why in skipped:
            log.warning("audit evidence left out: %s", why)
        for ev in found:
            self.tally.add(ev.verdict, ev.auditor)
            self.tally.failed(ev)
            self._fails.setdefault(ev.verdict.seq, {}).setdefault(ev.auditor, ev)
            self.evidence.setdefault(ev.verdict.seq, self.dir / f"{ev.verdict.seq}.json")
        self._publish()
        await self.binding.start()  # proofs read back, then the policy and steps topics' first validators
        if self._refusal:
            log.error("%s (read back from the evidence kept)", self._refusal)
        self._rt.swarm.subscribe(topic(self.run_id, AUDIT_KIND), self._validate, self._on_verdict,
                                 include_own=True)  # an auditing validator counts its own verdicts too

    async def close(self) -> None:
        pass

    def refusal(self) -> str:
        """Why this node does not follow the run's trainer ("" while it does): ``run.require_audits`` and
        a step the trainer failed (final), or audit coverage too low (lifted once it is back)."""
        return self._refusal or self._coverage_refusal

    def _record(self, rec: StepRecord) -> None:
        """A step record of the trainer the binding watch took (the event loop)."""
        self.coverage.record(rec, time.time())
        self._covered()

    def _covered(self) -> None:
        """After the coverage changed: warn (rate-limited), refuse or lift, publish."""
        why = self.coverage.low
        now = time.monotonic()
        if why and (not self._coverage_low or now - self._coverage_warned >= COVERAGE_WARN_S):
            self._coverage_warned = now
            log.warning("audit coverage of trainer %s too low: %s%s", self.trainer, why,
                        "; not following it until it is back (run.require_audits)" if self.required else "")
        elif not why and self._coverage_low:
            log.warning("audit coverage of trainer %s is back%s", self.trainer,
                        ": following it again" if self.required else "")
        self._coverage_low = why
        if self.required:
            refusal = (f"audit coverage too low: {why}: not following the trainer until it is back "
                       "(run.require_audits)") if why else ""
            if refusal != self._coverage_refusal:
                self._coverage_refusal = refusal
                self._rt.board.set_degraded("audit coverage", refusal)
        self._publish()

    def _validate(self, data: bytes, origin: str) -> tuple[AuditVerdict, str, bytes]:
        """The gossip validator (trio thread): signed by one of the run's auditors and published by it, of
        this run, about its trainer, sealed inside the window and not taken before; the envelope is kept
        with it for the evidence."""
        try:
            v, signer = self._open(data, origin)
            if v.trainer != self.trainer:
                raise ProtocolError(f"audit verdict about trainer {v.trainer[:64]!r}, the run's is "
                                    f"{self.trainer}")
            self._seen.take(signer, codec.encode(v), what=f"audit verdict on step {v.seq}")
        except MessageIgnored as exc:
            self.ignored[exc.kind] = self.ignored.get(exc.kind, 0) + 1
            raise
        return v, signer, data

    async def _on_verdict(self, msg: tuple[AuditVerdict, str, bytes], origin: str) -> None:
        v, auditor, data = msg
        async with self._lock:
            await self.take(v, auditor, data)

    async def take(self, v: AuditVerdict, auditor: str, envelope: bytes) -> None:
        """Count one verdict already opened and checked (the gossip handler's work, callable by tests)."""
        try:
            changed = self.tally.add(v, auditor)
        except ProtocolError as exc:
            self.refused["verdicts"] += 1
            self._rt.swarm.peerbook.record_rejection(auditor, f"{topic(self.run_id, AUDIT_KIND)}: {exc}")
            return
        self.tally.last_at = time.time()
        self.coverage.verdict(v, self.tally.last_at)
        self._covered()
        failing = self._fails.get(v.seq, {})
        if v.outcome == "fail" and auditor not in failing \
                and sum(auditor in f for f in self._fails.values()) < MAX_FAILS_PER_AUDITOR:
            ev = Evidence(v, auditor, envelope, self.tally.last_at)
            if len(failing) < self.quorum:  # each failure up to the quorum kept: checked again on restart
                try:
                    path = await asyncio.to_thread(write_evidence, self.dir, ev,
                                                   f"{v.seq}-{len(failing) + 1}" if failing else "")
                    self.evidence.setdefault(v.seq, path)
                except OSError as exc:  # the failure still counts here: a full disk must not hide it
                    log.error("could not keep the evidence of step %d in %s: %s; a restart will not "
                              "remember this failure", v.seq, self.dir, exc)
            self._fails.setdefault(v.seq, {})[auditor] = ev
            if changed:
                self.tally.failed(ev)
            self._failed(ev)
        self._publish()

    def _quorum_failed(self) -> tuple[Evidence, int] | None:
        """The lowest step ``run.audit_quorum`` auditors failed, its first failing verdict and how many."""
        for seq in sorted(self._fails):
            got = self._fails[seq]
            if len(got) >= self.quorum:
                return next(iter(got.values())), len(got)
        return None

    def _failed(self, ev: Evidence) -> None:
        v = ev.verdict
        what = (f"trainer {self.trainer} failed the audit of step {v.seq} (v{v.version}) by {ev.auditor}: "
                f"replay made {v.expected or '-'}, published {v.published}: "
                f"{clean_text(v.reason, REASON_CHARS)}")
        if not self.required:
            log.warning("%s (run.require_audits is off: still following it)", what)
            return
        failing = len(self._fails.get(v.seq, {}))
        if failing < self.quorum:
            log.warning("%s; %d of the %d auditors run.audit_quorum needs: still following it", what,
                        failing, self.quorum)
        elif not self._refusal:
            log.error("%s; not following it any more (run.require_audits), evidence in %s", what, self.dir)

    async def _proven(self, p: Proof) -> None:
        """The binding watch took a hash conflict (found here, heard and checked, or read back)."""
        what = f"{p.describe()} (found by {p.source})"
        if not self.required:
            log.warning("%s (run.require_audits is off: still following it)", what)
        elif not self._refusal:
            log.error("%s; not following it any more (run.require_audits), evidence in %s", what, self.dir)
        self._publish()

    def _failure(self) -> AuditFailure | None:
        """The failure a refusal names: the first failed step, else the first hash conflict."""
        first, proof = self.tally.first_failed, self.binding.first()
        if first is not None:
            return first.failure()
        if proof is None:
            return None
        c = proof.conflict
        return AuditFailure(seq=0, version=c.version, auditor=proof.source, expected=proof.hashes[0],
                            published=proof.hashes[1], reason=proof.describe(), ts=proof.received_at)

    def _publish(self) -> None:
        """The state to the status board (and, once refusing, the node's degraded reason)."""
        t = self.tally
        proof = self.binding.first()
        quorum = self._quorum_failed()
        if self.required and quorum is not None and not self._refusal:
            first, n = quorum
            v = first.verdict
            by = first.auditor if n == 1 else f"{n} auditors ({first.auditor}, ...)"
            self._refusal = (f"the trainer failed the audit of step {v.seq} (v{v.version}) by "
                             f"{by}: not following it (run.require_audits); evidence in "
                             f"{self.dir}")
            self._rt.board.set_degraded("audit", self._refusal)
        elif self.required and proof is not None and not self._refusal:
            self._refusal = (f"{proof.describe()}: not following it (run.require_audits); evidence in "
                             f"{self.dir}")
            self._rt.board.set_degraded("audit", self._refusal)
        failure = self._failure()
        self._rt.board.set_audits(Audits(
            state="failed" if proof is not None else t.state, trainer=self.trainer,
            auditors=len(self.auditors), heard_from=t.heard_from,
            audited=t.audited, passed=t.counts["passed"], failed=t.counts["failed"],
            unavailable=t.counts["unavailable"], last_verdict_at=t.last_at,
            first_failed=failure, required=self.required,
            refusing=bool(self.refusal()), detail=self.refusal() or self.detail,
            coverage=self.coverage.state, coverage_gap=self.coverage.gap,
            checkpoint_every=self.coverage.every, coverage_detail=self.coverage.low))

    def status(self) -> dict[str, Any]:
        t = self.tally
        first = t.first_failed
        return {"state": "failed" if self.binding.proofs else t.state, "trainer": self.trainer,
                "auditors": sorted(self.auditors),
                "heard_from": t.heard_from, "audited": t.audited, **t.counts,
                "required": self.required, "quorum": self.quorum, "refusing": bool(self.refusal()),
                "refusal": self.refusal(),
                "coverage": {"state": self.coverage.state, "gap": self.coverage.gap,
                             "checkpoint_every": self.coverage.every, "top_step": self.coverage.top,
                             "state_step": self.coverage.state_step,
                             "starts_unfetched": sorted(self.coverage.unfetched),
                             "detail": self.coverage.low},
                "failed_by": {str(seq): len(f) for seq, f in sorted(self._fails.items())[:MAX_EVIDENCE]},
                "detail": self.detail, "refused_verdicts": self.refused["verdicts"],
                "ignored_verdicts": dict(self.ignored),
                "first_failed": ({"seq": first.verdict.seq, "version": first.verdict.version,
                                  "auditor": first.auditor, "expected": first.verdict.expected,
                                  "published": first.verdict.published,
                                  "reason": clean_text(first.verdict.reason, REASON_CHARS)}
                                 if first is not None else None),
                "evidence": {str(seq): str(p) for seq, p in sorted(self.evidence.items())},
                "bindings": self.binding.status()}


def audit_gate(runtime: Runtime) -> Callable[[], str]:
    """What a role asks before it works for the run's trainer: the node's :meth:`AuditWatch.refusal`, or
    never a refusal where the node runs no audit watch (a role assembled without the common services)."""
    watch = runtime.service(AuditWatch)
    return watch.refusal if watch is not None else (lambda: "")
