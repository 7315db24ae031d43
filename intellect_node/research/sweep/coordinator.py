"""The sweep coordinator: which peer runs which job, spot checks, disputes, bans, as a pure state machine.

The coordinator (:class:`Coordinator`) is a pure state machine in the style of prime-rl's schedulers: it
owns no tasks, sockets or clocks. The node layer feeds it claims, results and the time, sends the grants
it returns, and appends the events it emits to the journal *before* sending anything (so a grant or an
accepted result is never lost by a crash). Every state change is an event; :meth:`Coordinator.restore`
replays a journal into the same state.

Rules:

- **No duplicate work except on purpose.** A job is granted to one peer at a time per missing vote; a
  peer never gets a job it already ran or holds.
- **Spot checks.** ``ceil(check_fraction * jobs)`` jobs (default 5%), chosen by an HMAC of the job ID
  under a salt only the coordinator knows, need a second, agreeing result from a *different* peer. The
  check is granted only after the first result arrives, and grants look the same either way, so a
  worker cannot tell which of its results will be re-executed.
- **Disputes.** Results that disagree go to a third peer (up to ``max_votes`` peers in all). A digest
  with at least two votes and more than any other wins; every peer that voted otherwise is banned, and
  all of its results, on every job, stop counting: those jobs are redone.
- **Vanished peers.** A grant past its deadline (or whose peer the heartbeats declare gone) expires and
  the job goes back to the pool.
- **Any number of workers from one up.** A check or tiebreak that no live, eligible peer can take for
  ``check_grace_s`` is *waived* (the first result stands, marked unchecked) or, for a dispute, the job is
  *abandoned* (reported as unresolved). Both are recorded, never hidden.

Shortcut: results are compared as ``(polysemantic count, sign-pattern hash)`` only; the float fields of
the first agreeing result (final loss, fourth-norm curve) are reported as they came. Collusion (two
peers forging the same wrong digest) is out of scope: it needs a sybil-resistant choice of checkers.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NotRequired, Sequence, TypedDict

import msgspec

from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.protocol import sweep as wire
from intellect_node.protocol.sweep import JobSpec, job_id
from intellect_node.research.sweep.grids import default_deadline_s

DEFAULT_CHECK_FRACTION = 0.05
"""Share of jobs re-executed by a second peer."""
DEFAULT_MAX_VOTES = 4
"""Executions of one job before a dispute without a majority is given up as unresolved."""
DEFAULT_CHECK_GRACE_S = 120.0

PRIMARY, CHECK, TIEBREAK = "primary", "check", "tiebreak"
Digest = tuple[int, str]


class ResultRecord(TypedDict):
    """One peer's result for a job, as the coordinator keeps it (a ``Result`` message's figures)."""

    polysemantic: int
    sign_hash: str
    final_loss: NotRequired[float]
    fourth_norm: NotRequired[list[list[float]]]
    """``(step, fourth norm)`` pairs of a noise job's curve."""
    seconds: NotRequired[float]


class SweepEvent(TypedDict):
    """One journal line after the header: what happened (``e``: grant, result, expire, waive, abandon or
    ban) at ``t`` (unix seconds), to which job and peer."""

    e: str
    t: float
    job: NotRequired[str]
    peer: NotRequired[str]
    deadline: NotRequired[float]
    role: NotRequired[str]
    reason: NotRequired[str]
    record: NotRequired[ResultRecord]


@dataclass(frozen=True)
class Grant:
    job_id: str
    spec: JobSpec
    peer: str
    role: str
    deadline: float  # unix seconds


@dataclass(frozen=True)
class Outcome:
    """What happened to one submitted result."""

    accepted: bool
    reason: str = ""  # why not, when not accepted
    banned: tuple[str, ...] = ()  # peers banned because of this result


@dataclass
class _Vote:
    digest: Digest
    record: ResultRecord


@dataclass
class _Job:
    spec: JobSpec
    id: str
    index: int
    checked: bool
    votes: dict[str, _Vote] = field(default_factory=dict)
    inflight: dict[str, float] = field(default_factory=dict)  # peer -> deadline
    granted: set[str] = field(default_factory=set)  # every peer ever granted this job
    waived: bool = False
    abandoned: bool = False
    open_since: float = 0.0  # when the job last started needing a vote


@dataclass(frozen=True)
class _Verdict:
    state: str  # "open" | "done" | "unresolved" | "stuck"
    need: int = 0
    role: str = PRIMARY
    winner: Digest | None = None
    liars: tuple[str, ...] = ()


def _digest_of(record: ResultRecord) -> Digest:
    return (int(record["polysemantic"]), str(record["sign_hash"]))


def spot_checked(job_ids: Sequence[str], salt: bytes, fraction: float) -> set[str]:
    """The ``ceil(fraction * len)`` job IDs with the smallest HMAC-SHA256 under ``salt``."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"check fraction {fraction} must be within [0, 1], e.g. 0.05",
                          field="check_fraction")
    k = math.ceil(fraction * len(job_ids) - 1e-9)
    ranked = sorted(job_ids, key=lambda j: hmac.new(salt, j.encode(), hashlib.sha256).digest())
    return set(ranked[:k])


class Coordinator:
    """The sweep's bookkeeping. Methods take ``now`` (unix seconds) and return what to send."""

    def __init__(self, jobs: Sequence[JobSpec], *, salt: bytes,
                 check_fraction: float = DEFAULT_CHECK_FRACTION, max_votes: int = DEFAULT_MAX_VOTES,
                 check_grace_s: float = DEFAULT_CHECK_GRACE_S, deadline_scale: float = 1.0,
                 started: float = 0.0) -> None:
        if max_votes < 3:
            raise ConfigError("max_votes must be at least 3 (two results and a tiebreak)", field="max_votes")
        self.salt = salt
        self.check_fraction = check_fraction
        self.max_votes = max_votes
        self.check_grace_s = check_grace_s
        self.deadline_scale = deadline_scale
        self.jobs: dict[str, _Job] = {}
        for i, spec in enumerate(jobs):
            wire.check_spec(spec)
            jid = job_id(spec)
            if jid in self.jobs:
                raise ConfigError(f"job {i} repeats job {self.jobs[jid].index} of the grid", field="grid")
            self.jobs[jid] = _Job(spec, jid, i, checked=False, open_since=started)
        for jid in spot_checked(list(self.jobs), salt, check_fraction):
            self.jobs[jid].checked = True
        self.banned: dict[str, str] = {}
        self.last_seen: dict[str, float] = {}  # in memory only: liveness for waivers
        self.pending: list[SweepEvent] = []  # emitted events not yet drained to the journal
        self.rejections: Counter[str] = Counter()

    # -- journal ------------------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        """What the journal's first line holds: enough to rebuild the coordinator."""
        return {"e": "header", "salt": self.salt.hex(), "check_fraction": self.check_fraction,
                "max_votes": self.max_votes, "check_grace_s": self.check_grace_s,
                "deadline_scale": self.deadline_scale,
                "jobs": [msgspec.to_builtins(j.spec)
                         for j in sorted(self.jobs.values(), key=lambda j: j.index)]}

    @classmethod
    def restore(cls, header: dict[str, Any], events: Iterable[SweepEvent]) -> "Coordinator":
        """Rebuild from a journal's header and events (no decisions are re-made: events are facts)."""
        try:
            jobs = [msgspec.convert(j, JobSpec) for j in header["jobs"]]
            self = cls(jobs, salt=bytes.fromhex(header["salt"]), check_fraction=header["check_fraction"],
                       max_votes=header["max_votes"], check_grace_s=header["check_grace_s"],
                       deadline_scale=header["deadline_scale"])
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"journal header is not a sweep header: {exc}") from exc
        for ev in events:
            self._apply(ev)
        return self

    def drain(self) -> list[SweepEvent]:
        """Events emitted since the last drain, for the journal; persist them before sending anything."""
        out, self.pending = self.pending, []
        return out

    def _emit(self, ev: SweepEvent) -> None:
        self._apply(ev)
        self.pending.append(ev)

    def _apply(self, ev: SweepEvent) -> None:
        kind, t = ev["e"], float(ev["t"])
        if kind == "ban":
            self.banned[ev["peer"]] = ev["reason"]
            for job in self.jobs.values():
                if job.inflight.pop(ev["peer"], None) is not None or ev["peer"] in job.votes:
                    job.open_since = t
            return
        job = self.jobs[ev["job"]]
        if kind == "grant":
            job.inflight[ev["peer"]] = float(ev["deadline"])
            job.granted.add(ev["peer"])
        elif kind == "result":
            job.inflight.pop(ev["peer"], None)
            job.votes[ev["peer"]] = _Vote(_digest_of(ev["record"]), ev["record"])
            job.open_since = t
        elif kind == "expire":
            job.inflight.pop(ev["peer"], None)
            job.open_since = t
        elif kind == "waive":
            job.waived = True
        elif kind == "abandon":
            job.abandoned = True
        else:
            raise ProtocolError(f"unknown journal event {kind!r}")

    # -- state --------------------------------------------------------------------------------------

    def _verdict(self, job: _Job) -> _Verdict:
        if job.abandoned:
            return _Verdict("unresolved")
        votes = {p: v for p, v in job.votes.items() if p not in self.banned}
        if not votes:
            return _Verdict("open", need=1, role=PRIMARY)
        counts = Counter(v.digest for v in votes.values())
        if len(counts) == 1:
            (digest, c), = counts.items()
            required = 2 if job.checked and not job.waived else 1
            if c >= required:
                return _Verdict("done", winner=digest)
            return _Verdict("open", need=required - c, role=CHECK)
        (best, bc), (_, second) = counts.most_common(2)
        if bc >= 2 and bc > second:
            liars = tuple(sorted(p for p, v in votes.items() if v.digest != best))
            return _Verdict("done", winner=best, liars=liars)
        if len(votes) >= self.max_votes:
            return _Verdict("stuck")
        return _Verdict("open", need=1, role=TIEBREAK)

    def status(self, jid: str) -> str:
        """``open`` | ``done`` | ``unresolved`` for one job."""
        state = self._verdict(self.jobs[jid]).state
        return "unresolved" if state == "stuck" else state

    def counts(self) -> dict[str, int]:
        c = Counter(self.status(j) for j in self.jobs)
        return {"jobs": len(self.jobs), "done": c["done"], "open": c["open"], "unresolved": c["unresolved"],
                "inflight": sum(len(j.inflight) for j in self.jobs.values()),
                "checks": sum(1 for j in self.jobs.values() if j.checked),
                "waived": sum(1 for j in self.jobs.values() if j.waived), "banned": len(self.banned)}

    def finished(self) -> bool:
        return all(self.status(j) != "open" for j in self.jobs)

    def _slots(self, job: _Job) -> tuple[int, str]:
        v = self._verdict(job)
        return (max(0, v.need - len(job.inflight)), v.role) if v.state == "open" else (0, v.role)

    def _eligible(self, job: _Job, peer: str) -> bool:
        return peer not in job.votes and peer not in job.inflight

    def open_jobs(self, limit: int = wire.MAX_JOBS_PER_MESSAGE) -> list[JobSpec]:
        """Jobs with a free slot, tiebreaks and checks first (they unblock results and catch liars)."""
        order = {TIEBREAK: 0, CHECK: 1, PRIMARY: 2}
        ranked = []
        for job in self.jobs.values():
            slots, role = self._slots(job)
            if slots:
                ranked.append((order[role], job.index, job.spec))
        return [spec for *_, spec in sorted(ranked)[:limit]]

    # -- inputs -------------------------------------------------------------------------------------

    def claim(self, peer: str, job_ids: Sequence[str], capacity: int, now: float) -> list[Grant]:
        """``peer`` is idle and asks for up to ``capacity`` jobs (``job_ids`` first). Returns grants."""
        if peer in self.banned or capacity <= 0:
            return []
        self.last_seen[peer] = now
        preferred = [self.jobs[j] for j in dict.fromkeys(job_ids) if j in self.jobs]
        order = {TIEBREAK: 0, CHECK: 1, PRIMARY: 2}
        rest = sorted(self.jobs.values(), key=lambda j: (order[self._slots(j)[1]], j.index))
        grants: list[Grant] = []
        for job in [*preferred, *rest]:
            if len(grants) >= capacity:
                break
            slots, role = self._slots(job)
            if slots <= 0 or not self._eligible(job, peer):
                continue
            deadline = now + self.deadline_scale * default_deadline_s(job.spec)
            self._emit({"e": "grant", "t": now, "job": job.id, "peer": peer, "deadline": deadline,
                        "role": role})
            grants.append(Grant(job.id, job.spec, peer, role, deadline))
        return grants

    def result(self, peer: str, jid: str, record: ResultRecord, now: float) -> Outcome:
        """A result from ``peer``; ``record`` holds at least ``polysemantic`` and ``sign_hash``."""
        job = self.jobs.get(jid)
        if job is None:
            return self._reject(peer, "unknown job")
        if peer in self.banned:
            return Outcome(False, "banned")
        if peer in job.votes:
            return Outcome(False, "duplicate")  # a gossip repeat: harmless, not held against the peer
        if peer not in job.granted:
            return self._reject(peer, "result for a job not granted to this peer")
        bound = wire.curve_points(job.spec)
        if int(record["polysemantic"]) > job.spec.m or len(record.get("fourth_norm", ())) != bound:
            # Impossible for an honest run (more polysemantic neurons than neurons, a wrong curve).
            self._emit({"e": "ban", "t": now, "peer": peer, "reason": f"impossible result for job {jid}"})
            return Outcome(False, "impossible result", banned=(peer,))
        self.last_seen[peer] = now
        self._emit({"e": "result", "t": now, "job": jid, "peer": peer, "record": record})
        banned: list[str] = []
        verdict = self._verdict(job)
        for liar in verdict.liars:
            self._emit({"e": "ban", "t": now, "peer": liar,
                        "reason": f"result for job {jid} disagrees with the majority of re-executions"})
            banned.append(liar)
        if verdict.state == "stuck":
            self._emit({"e": "abandon", "t": now, "job": jid})
        return Outcome(True, banned=tuple(banned))

    def _reject(self, peer: str, reason: str) -> Outcome:
        self.rejections[peer] += 1
        return Outcome(False, reason)

    def peer_gone(self, peer: str, now: float) -> list[str]:
        """The heartbeats lost ``peer``: expire its grants now. Returns the job IDs put back."""
        self.last_seen.pop(peer, None)
        out = []
        for job in self.jobs.values():
            if peer in job.inflight:
                self._emit({"e": "expire", "t": now, "job": job.id, "peer": peer})
                out.append(job.id)
        return out

    def tick(self, now: float) -> None:
        """Expire grants past their deadline; waive or abandon what no live, eligible peer can take."""
        for job in self.jobs.values():
            for peer, deadline in list(job.inflight.items()):
                if deadline < now:
                    self._emit({"e": "expire", "t": now, "job": job.id, "peer": peer})
        live = {p for p, t in self.last_seen.items()
                if now - t <= self.check_grace_s and p not in self.banned}
        live |= {p for j in self.jobs.values() for p in j.inflight}
        for job in self.jobs.values():
            v = self._verdict(job)
            if v.state != "open" or v.role == PRIMARY or job.inflight:
                continue
            if now - job.open_since < self.check_grace_s:
                continue
            if any(self._eligible(job, p) for p in live):
                continue
            self._emit({"e": "waive" if v.role == CHECK else "abandon", "t": now, "job": job.id})

    # -- results ------------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """One row per job for ``results.jsonl``: spec, status, the accepted result and who agreed."""
        out = []
        for job in sorted(self.jobs.values(), key=lambda j: j.index):
            v = self._verdict(job)
            row: dict[str, Any] = {"job_id": job.id, **msgspec.to_builtins(job.spec)}
            votes = {p: vote for p, vote in job.votes.items() if p not in self.banned}
            if v.state == "done":
                agreeing = sorted((p for p, vote in votes.items() if vote.digest == v.winner),
                                  key=lambda p: list(job.votes).index(p))
                row["status"] = "done"
                row["check"] = ("waived" if job.waived else "agreed") if job.checked else "none"
                row["peers"] = agreeing
                rec: Mapping[str, object] = votes[agreeing[0]].record
                row.update({k: rec[k] for k in ("polysemantic", "sign_hash", "final_loss", "fourth_norm",
                                                "seconds") if k in rec})
            else:
                row["status"] = "unresolved" if v.state in ("unresolved", "stuck") else "open"
                row["votes"] = {p: list(vote.digest) for p, vote in votes.items()}
            out.append(row)
        return out
