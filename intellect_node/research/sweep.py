"""Sweeps of many small training runs: grids, job IDs, the coordinator state machine, the journal, results.

The coordinator (:class:`Coordinator`) is a pure state machine in the style of prime-rl's schedulers: it
owns no tasks, sockets or clocks. The node layer feeds it claims, results and the time, sends the grants
it returns, and appends the events it emits to the journal *before* sending anything (so a grant or an
accepted result is never lost by a crash). Every state change is an event; :meth:`Coordinator.restore`
replays a journal into the same state.

Rules (issue 6):

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
import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import msgspec

from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.fsutil import atomic_write_text
from intellect_node.protocol import sweep as wire
from intellect_node.protocol.sweep import JobSpec, job_id

log = logging.getLogger(__name__)

GRIDS = ("smoke", "paper", "noise", "tiny")
DEFAULT_CHECK_FRACTION = 0.05
"""Share of jobs re-executed by a second peer (issue 6's default)."""
DEFAULT_MAX_VOTES = 4
"""Executions of one job before a dispute without a majority is given up as unresolved."""
DEFAULT_CHECK_GRACE_S = 120.0
MIN_DEADLINE_S = 120.0
DEADLINE_FACTOR = 10.0
"""Deadlines are a backstop (heartbeats report dead peers within seconds), so they are generous: on a
2-core machine at load 20, smoke jobs ran 3-4x slower than the estimate and 60 s + 3x expired two."""
ASSUMED_FLOPS = 5e9
"""Single-thread float32 rate assumed for deadlines: well under a modern core, so slow peers make it."""
ASSUMED_STEP_OVERHEAD_S = 2e-4
"""Python and dispatch cost per training step, measured at about 1e-4 s on a loaded 2-core machine."""

PRIMARY, CHECK, TIEBREAK = "primary", "check", "tiebreak"
Digest = tuple[int, str]


# -- grids -------------------------------------------------------------------------------------------

def poly_job(n: int, m: int, seed: int, *, steps: int = 7500) -> JobSpec:
    """The main experiment's settings (AdamW lr 1e-3, torch's default decay 0.01, L1 1e-3)."""
    return JobSpec(variant="poly", n=n, m=m, seed=seed, steps=steps, lr=1e-3, l1=1e-3, weight_decay=0.01)


def noise_job(noise: str, sigma: float, seed: int, *, steps: int = 100_000,
              record_every: int = 1000) -> JobSpec:
    """The noise variant's settings (n 8, m 16, SGD lr 0.02, no L1)."""
    return JobSpec(variant="noise", n=8, m=16, seed=seed, steps=steps, lr=0.02, l1=0.0, noise=noise,
                   sigma=sigma, record_every=record_every)


def grid(name: str) -> list[JobSpec]:
    """The jobs of a named grid.

    - ``smoke``: n 64, m in {64, 128, 256, 512}, seeds 0-9 (40 jobs, minutes on one core);
    - ``paper``: n 256, m 256..4096 in steps of 256, 16 seeds (256 jobs, hours: for a real swarm);
    - ``noise``: Bernoulli and Gaussian noise at sigma 0.07, 0.1, 0.15, plus a noiseless baseline,
      5 instances each (35 jobs);
    - ``tiny``: n 16, m in {16, 32}, 3 seeds, 1500 steps: for tests and demos, not a result.
    """
    if name == "smoke":
        return [poly_job(64, m, s) for m in (64, 128, 256, 512) for s in range(10)]
    if name == "paper":
        return [poly_job(256, m, s) for m in range(256, 4097, 256) for s in range(16)]
    if name == "noise":
        kinds = [(k, sg) for k in ("bernoulli", "gaussian") for sg in (0.07, 0.1, 0.15)] + [("none", 0.0)]
        return [noise_job(k, sg, s) for k, sg in kinds for s in range(5)]
    if name == "tiny":
        return [poly_job(16, m, s, steps=1500) for m in (16, 32) for s in range(3)]
    raise ConfigError(f"--grid {name!r} is not a grid; use one of {', '.join(GRIDS)}", field="grid")


def theory(n: int, m: int) -> float:
    """Expected polysemantic neurons, n^2 / (4m): collisions of n features on m neurons, of which the
    opposite-sign half survive the ReLU (the paper's estimate)."""
    return n * n / (4 * m)


def estimated_seconds(spec: JobSpec) -> float:
    """A pessimistic single-thread run time: matmul flops at :data:`ASSUMED_FLOPS` plus step overhead."""
    n, m = spec.n, spec.m
    per_step = (6 if spec.variant == "noise" else 4) * n * n * m + 20 * n * m
    return spec.steps * (per_step / ASSUMED_FLOPS + ASSUMED_STEP_OVERHEAD_S)


def default_deadline_s(spec: JobSpec) -> float:
    """Time a peer gets for one job: two minutes plus ten times the pessimistic estimate."""
    return MIN_DEADLINE_S + DEADLINE_FACTOR * estimated_seconds(spec)


def execute(spec: JobSpec) -> Any:
    """Run one job here (torch, one thread) and return its ``RunResult``; for workers, never the loop."""
    from intellect_node.research import polysemanticity as poly

    wire.check_spec(spec)
    if spec.variant == "poly":
        return poly.run_polysemanticity(spec.n, spec.m, spec.seed, steps=spec.steps, lr=spec.lr, l1=spec.l1,
                                        weight_decay=spec.weight_decay)
    return poly.run_noise(spec.n, spec.m, spec.seed, noise=spec.noise, sigma=spec.sigma,  # type: ignore[arg-type]
                          steps=spec.steps, lr=spec.lr, l1=spec.l1, record_every=spec.record_every)


# -- the coordinator ---------------------------------------------------------------------------------

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
    record: dict[str, Any]


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


def _digest_of(record: dict[str, Any]) -> Digest:
    return (int(record["polysemantic"]), str(record["sign_hash"]))


def spot_checked(job_ids: Sequence[str], salt: bytes, fraction: float) -> set[str]:
    """The ``ceil(fraction * len)`` job IDs with the smallest HMAC-SHA256 under ``salt``."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"check fraction {fraction} must be within [0, 1], e.g. 0.05", field="check_fraction")
    k = math.ceil(fraction * len(job_ids) - 1e-9)
    ranked = sorted(job_ids, key=lambda j: hmac.new(salt, j.encode(), hashlib.sha256).digest())
    return set(ranked[:k])


class Coordinator:
    """The sweep's bookkeeping. Methods take ``now`` (unix seconds) and return what to send."""

    def __init__(self, jobs: Sequence[JobSpec], *, salt: bytes, check_fraction: float = DEFAULT_CHECK_FRACTION,
                 max_votes: int = DEFAULT_MAX_VOTES, check_grace_s: float = DEFAULT_CHECK_GRACE_S,
                 deadline_scale: float = 1.0, started: float = 0.0) -> None:
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
        self.pending: list[dict[str, Any]] = []  # emitted events not yet drained to the journal
        self.rejections: Counter[str] = Counter()

    # -- journal ------------------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        """What the journal's first line holds: enough to rebuild the coordinator."""
        return {"e": "header", "salt": self.salt.hex(), "check_fraction": self.check_fraction,
                "max_votes": self.max_votes, "check_grace_s": self.check_grace_s,
                "deadline_scale": self.deadline_scale,
                "jobs": [msgspec.to_builtins(j.spec) for j in sorted(self.jobs.values(), key=lambda j: j.index)]}

    @classmethod
    def restore(cls, header: dict[str, Any], events: Iterable[dict[str, Any]]) -> "Coordinator":
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

    def drain(self) -> list[dict[str, Any]]:
        """Events emitted since the last drain, for the journal; persist them before sending anything."""
        out, self.pending = self.pending, []
        return out

    def _emit(self, ev: dict[str, Any]) -> None:
        self._apply(ev)
        self.pending.append(ev)

    def _apply(self, ev: dict[str, Any]) -> None:
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
            self._emit({"e": "grant", "t": now, "job": job.id, "peer": peer, "deadline": deadline, "role": role})
            grants.append(Grant(job.id, job.spec, peer, role, deadline))
        return grants

    def result(self, peer: str, jid: str, record: dict[str, Any], now: float) -> Outcome:
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
        live = {p for p, t in self.last_seen.items() if now - t <= self.check_grace_s and p not in self.banned}
        live |= {p for j in self.jobs.values() for p in j.inflight}
        for job in self.jobs.values():
            v = self._verdict(job)
            if v.state != "open" or v.role == PRIMARY or job.inflight or now - job.open_since < self.check_grace_s:
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
                rec = votes[agreeing[0]].record
                row.update({k: rec[k] for k in ("polysemantic", "sign_hash", "final_loss", "fourth_norm",
                                                "seconds") if k in rec})
            else:
                row["status"] = "unresolved" if v.state in ("unresolved", "stuck") else "open"
                row["votes"] = {p: list(vote.digest) for p, vote in votes.items()}
            out.append(row)
        return out


# -- the journal -------------------------------------------------------------------------------------

class Journal:
    """Append-only JSON lines: a header, then events. Each append is flushed and fsynced before return."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f: Any = None

    def create(self, header: dict[str, Any]) -> None:
        if self.path.exists():
            raise ConfigError(f"{self.path} exists: pass --resume to continue that sweep, or another --out",
                              field="out")
        atomic_write_text(self.path, json.dumps(header, sort_keys=True) + "\n")

    def load(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The header and events; a torn last line (a crash mid-append) is dropped, anything else fails."""
        if not self.path.exists():
            raise ConfigError(f"--resume: no journal at {self.path}; start the sweep without --resume",
                              field="resume")
        lines = self.path.read_text().splitlines()
        events = []
        for i, line in enumerate(lines):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(lines) - 1 and i > 0:
                    log.warning("dropping a torn last line of %s", self.path)
                    break
                raise ProtocolError(f"{self.path}:{i + 1} is not JSON: {exc}") from exc
        if not events or events[0].get("e") != "header":
            raise ProtocolError(f"{self.path} does not start with a sweep header")
        return events[0], events[1:]

    def append(self, events: Sequence[dict[str, Any]]) -> None:
        if not events:
            return
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write("".join(json.dumps(ev, sort_keys=True) + "\n" for ev in events))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# -- aggregation -------------------------------------------------------------------------------------

def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value)."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per (n, m): mean, std, seeds, counts, theory (poly); per (noise, sigma): fourth-norm curves (noise)."""
    done = [r for r in rows if r["status"] == "done"]
    poly: dict[tuple[int, int], list[dict[str, Any]]] = {}
    noise: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in done:
        if r["variant"] == "poly":
            poly.setdefault((r["n"], r["m"]), []).append(r)
        else:
            noise.setdefault((r["noise"], r["sigma"]), []).append(r)
    configs = []
    for (n, m), rs in sorted(poly.items()):
        rs.sort(key=lambda r: r["seed"])
        mean, std = _mean_std([r["polysemantic"] for r in rs])
        configs.append({"n": n, "m": m, "mean": mean, "std": std, "seeds": [r["seed"] for r in rs],
                        "counts": [r["polysemantic"] for r in rs], "theory": theory(n, m)})
    curves = []
    for (kind, sigma), rs in sorted(noise.items()):
        rs.sort(key=lambda r: r["seed"])
        steps = [s for s, _ in rs[0]["fourth_norm"]]
        per_step = list(zip(*[[v for _, v in r["fourth_norm"]] for r in rs]))
        finals = [r["fourth_norm"][-1][1] for r in rs]
        mean, std = _mean_std(finals)
        curves.append({"noise": kind, "sigma": sigma, "seeds": [r["seed"] for r in rs], "steps": steps,
                       "mean_curve": [sum(v) / len(v) for v in per_step], "final_mean": mean, "final_std": std})
    return {"configs": configs, "noise_curves": curves,
            "jobs": len(rows), "done": len(done),
            "unresolved": [r["job_id"] for r in rows if r["status"] == "unresolved"],
            "open": [r["job_id"] for r in rows if r["status"] == "open"],
            "checks": {k: sum(1 for r in done if r.get("check") == k) for k in ("agreed", "waived")}}


def table(summary: dict[str, Any]) -> str:
    """The per-(n, m) table in Markdown (mean +/- std beside n^2/4m)."""
    lines = ["| n | m | seeds | polysemantic (mean ± std) | theory n²/4m |", "|---|---|---|---|---|"]
    for c in summary["configs"]:
        lines.append(f"| {c['n']} | {c['m']} | {len(c['seeds'])} | {c['mean']:.2f} ± {c['std']:.2f} | "
                     f"{c['theory']:.2f} |")
    for c in summary["noise_curves"]:
        lines.append(f"| noise {c['noise']} σ={c['sigma']} | | {len(c['seeds'])} | fourth norm "
                     f"{c['final_mean']:.3f} ± {c['final_std']:.3f} | |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """log-log counts vs m with the theory line (poly); fourth norm vs steps per configuration (noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_poly, has_noise = bool(summary["configs"]), bool(summary["noise_curves"])
    fig, axes = plt.subplots(1, has_poly + has_noise or 1, figsize=(6 * (has_poly + has_noise or 1), 4.5),
                             squeeze=False)
    ax_iter = iter(axes[0])
    if has_poly:
        ax = next(ax_iter)
        cs = summary["configs"]
        for n in sorted({c["n"] for c in cs}):
            sub = [c for c in cs if c["n"] == n]
            ms = [c["m"] for c in sub]
            for c in sub:  # every seed, slightly transparent; zero counts cannot go on a log axis
                pts = [x for x in c["counts"] if x > 0]
                ax.scatter([c["m"]] * len(pts), pts, s=10, alpha=0.3, color="tab:blue")
            pos = [c for c in sub if c["mean"] > 0]  # a log axis cannot show 0; the table does
            if pos:
                # Lower bars stop short of 0 for the same reason.
                lower = [min(c["std"], 0.9 * c["mean"]) for c in pos]
                ax.errorbar([c["m"] for c in pos], [c["mean"] for c in pos], yerr=[lower, [c["std"] for c in pos]],
                            fmt="o-", capsize=3, color="tab:blue", label=f"measured mean ± std (n={n})")
            ax.plot(ms, [theory(n, m) for m in ms], "k--", label="theory n²/(4m)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("neurons m")
        ax.set_ylabel("polysemantic neurons")
        ax.set_title("Incidental polysemanticity")
        ax.legend()
    if has_noise:
        ax = next(ax_iter)
        for c in summary["noise_curves"]:
            style = {"bernoulli": "-", "gaussian": "--", "none": ":"}.get(c["noise"], "-")
            ax.plot(c["steps"], c["mean_curve"], style, label=f"{c['noise']} σ={c['sigma']}")
        ax.set_xlabel("step")
        ax.set_ylabel("mean over features of Σ_h W⁴")
        ax.set_title("Noise variant: fourth norm (mean over instances)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_outputs(out: Path, coord: Coordinator, *, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``results.jsonl``, ``summary.json`` and ``plot.png`` into ``out``; return the summary."""
    return write_report(out, coord.rows(), dict(coord.banned), meta=meta)


def write_report(out: Path, rows: list[dict[str, Any]], banned: dict[str, str], *,
                 meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`write_outputs` from a snapshot of the rows (safe off the thread that owns the coordinator)."""
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    summary = summarize(rows)
    summary.update(meta or {})
    summary["banned"] = banned
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    plot(summary, out / "plot.png")
    return summary
