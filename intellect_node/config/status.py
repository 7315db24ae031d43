"""What a node is doing, as one frozen value: the :class:`StatusSnapshot`, and the :class:`StatusBoard`
that node parts update and that publishes snapshots.

Every view of a node is rendered from the same snapshot: the control API serves ``to_json()``, the
dashboard renders it, ``/metrics`` exports from the same counters (``node/metrics.py``), and
``intellect-node status`` prints it. The core never formats for a terminal.

Who updates what (all methods are thread-safe: the swarm runs on a trio thread, roles on asyncio, torch
in worker threads):

- runtime/swarm: :meth:`StatusBoard.set_identity`, :meth:`set_run`, :meth:`set_peers`,
  :meth:`set_reachability`;
- blob fetches: :meth:`shard_progress`, :meth:`shard_done`;
- worker: :meth:`set_policy`, :meth:`rollouts_generated` (with token counts), :meth:`rollouts_submitted`,
  :meth:`verdict` for each verdict it receives;
- validator: :meth:`proof_checked` for each batch it checks, :meth:`verdict` for each verdict it issues,
  :meth:`set_held_out` with the newest held-out evaluation it took (``roles/validator/evals.py``);
- trainer: :meth:`set_policy`, :meth:`train_step` per optimizer step, :meth:`train_attempt` per step
  attempt (trained or not: see "Learning signal" below);
- trainer and worker: :meth:`completions` with a few of the completions they scored;
- the audit watch (``roles/common/audits.py``, every node of a run): :meth:`set_audits`;
- anyone: :meth:`warn`. A ``logging.Handler`` (:class:`BoardLogHandler`) forwards WARNING+ records;
  ``join`` installs it for every node, headless or not;
- runtime (liveness): :meth:`set_degraded` with a reason per part ("" once it works again),
  :meth:`set_restarts`, and :meth:`refreshed` from its status loop every second.

Timeline (``snapshot.timeline``): seconds from this *process's* start (not the board's creation: the
imports and key loading before the runtime exists are part of what a joining operator waits for) to
the first time the node was ``ready`` (state ``running``), had a peer, held a policy, submitted a batch
and had a batch accepted. The first three are marked by the setters that report them
(:meth:`set_state`, :meth:`set_peers`, :meth:`set_policy`); the worker marks its batch stages with
:meth:`mark`; the runtime marks ``first_peer`` when its bootstrap dials return with a peer reached
(the dials run together, so the slowest counts: gossip from the first peer, and with it a policy, can
come a little earlier), and its once-a-second status loop marks it for a node whose first peer dialled
in. A stage is marked once and never moves.

Learning signal (``snapshot.training``): every time the trainer takes queued batches for a step it
reports the attempt, trained or not, with how many groups the online filter dropped (rewards all equal:
zero advantage) and, when it dropped them all, why (:data:`NO_SIGNAL_CAUSES`) and a short hint on the
likely causes. The newest attempts with no learnable group in a row are ``no_signal_streak``; once they
reach :data:`NO_SIGNAL_ATTEMPTS`, or the first of them is :data:`NO_SIGNAL_WINDOW_S` old, the snapshot
carries ``no_signal_warning`` (cleared by the next trained step). Each trained step also reports its
sizes (``training.diagnostics``: KL to the sampler, the cut fraction, ratios, gradient norm, lr, entropy,
staleness) and ``training.step_warning`` while the last one was too large. ``training.completions`` holds the
newest :data:`RECENT_COMPLETIONS` completions the node scored (peer-supplied text: the board truncates it
and strips control characters, so no view has to).

Health: a ``running`` node with any degraded reason reads ``degraded`` (``snapshot.state``), with the
reasons in ``snapshot.health.reasons``. ``health.refreshed_at`` is when the runtime's status loop last
ran; a reader that sees it (or the snapshot's ``ts``) older than :data:`STALE_AFTER_S` must treat the
numbers as stale, not as a healthy node's (:meth:`StatusSnapshot.freshness`).

Shortcuts: tokens/s is the token count over a sliding window of :data:`RATE_WINDOW_S` seconds (not an
EMA), so it reads 0 once generation has stopped for that long. Histories are bounded rings; the
snapshot is copied on each call to :meth:`snapshot` (a few KB; cheap at dashboard/scrape rates).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import msgspec

from intellect_node.errors import ProtocolError

RATE_WINDOW_S = 30.0
"""Seconds of generated tokens that tokens/s is averaged over."""
HISTORY_LEN = 240
FIRST_LEN = 10
"""Steps kept from the start of training whatever the history holds: the dashboard's "first10" trend
(the demo makes more than HISTORY_LEN steps in three minutes)."""
"""Training points kept for the reward and pass-rate trends (a sparkline shows the last ~60)."""
RECENT_LEN = 8
"""Rejections and warnings kept in a snapshot (the dashboard shows the last few)."""
RECENT_COMPLETIONS = 8
"""Completions kept in a snapshot (``training.completions``): enough to see what the model writes."""
COMPLETION_CHARS = 200
"""A completion's text in a snapshot is cut to this many characters (the answer is usually at its end:
the tail is kept)."""
PROMPT_CHARS = 120
"""A problem's prompt in a snapshot is cut to this many characters (its start is kept)."""
ANSWER_CHARS = 60
"""Extracted and expected answers in a snapshot are cut to this many characters."""
NO_SIGNAL_ATTEMPTS = 3
"""Step attempts in a row with no learnable group that raise ``training.no_signal_warning``: a run whose
groups are learnable has this happen by chance only with a handful of groups per step."""
NO_SIGNAL_WINDOW_S = 60.0
"""Fewer attempts raise it too once the first of them is this old: a slow run (a big model on a CPU)
shows it within a minute of its first unlearnable attempt."""
NO_SIGNAL_CAUSES = ("all_zero", "all_one", "all_equal", "no_groups")
"""Why an attempt had no learnable group: every reward 0; every reward 1 (the maximum); each group's
rewards equal at another value (or groups at 0 and groups at 1); no group at all (every one left out
because its reward could not be judged in time)."""
MAX_SHARDS_SHOWN = 8
"""Shard downloads listed in a snapshot (finished ones drop out)."""
MAX_STATUS_BYTES = 4 * 1024 * 1024
"""Largest status JSON accepted by :meth:`StatusSnapshot.from_json` (real ones are a few KB)."""
STALE_AFTER_S = 5.0
"""A snapshot (or its status loop's last refresh) older than this is stale: the loop runs every second."""


@dataclass(frozen=True)
class Identity:
    peer_id: str = ""
    version: str = ""
    data_dir: str = ""
    listen_addrs: tuple[str, ...] = ()
    http_url: str = ""
    metrics_url: str = ""

    @property
    def share_addr(self) -> str:
        """The multiaddr to hand to others (``--bootstrap``): a full one ending ``/p2p/<id>``, preferring
        one other machines can dial over loopback and the unspecified address."""
        full = [a for a in self.listen_addrs if "/p2p/" in a]
        local = ("/ip4/127.", "/ip6/::1/", "/ip4/0.0.0.0/", "/ip6/::/")
        return next((a for a in full if not a.startswith(local)), full[0] if full else "")


@dataclass(frozen=True)
class RunInfo:
    run_id: str = ""
    model: str = ""
    dtype: str = ""
    trainer_peer_id: str = ""
    async_level: int = 0


@dataclass(frozen=True)
class Peers:
    """Connected peers, and the inbound cap: slots held by open inbound connections, the cap (libp2p's
    ``max_connections - min_connections``) and inbound connections refused at the cap so far. And the
    gossip messages our validators judged so far, not delivered: refused (blamed on their origin) and
    ignored (blamed on no one: stamped outside the window, or a repeat of one taken; what replays are)."""

    count: int = 0
    trainers: tuple[str, ...] = ()
    validators: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    inbound_in_use: int = 0
    inbound_cap: int = 0
    inbound_refused: int = 0
    gossip_refused: int = 0
    gossip_ignored_stale: int = 0
    gossip_ignored_repeat: int = 0


@dataclass(frozen=True)
class Reachability:
    """``status`` is one of ``unknown``, ``public``, ``private``, ``relayed``."""

    status: str = "unknown"
    public_addrs: tuple[str, ...] = ()
    relay: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Policy:
    """``current`` is the newest policy version announced in the swarm; ``local`` the one loaded here.
    ``staleness`` = current - local, in trainer steps (the worker may lag by at most ``async_level``)."""

    current: int = -1
    local: int = -1
    updated_at: float = 0.0

    @property
    def staleness(self) -> int:
        if self.current < 0 or self.local < 0:
            return 0
        return max(0, self.current - self.local)


@dataclass(frozen=True)
class ShardProgress:
    name: str
    cid: str
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class Shards:
    active: tuple[ShardProgress, ...] = ()
    bytes_downloaded: int = 0
    completed: int = 0


@dataclass(frozen=True)
class Rejection:
    ts: float
    reason: str
    detail: str = ""
    peer: str = ""


@dataclass(frozen=True)
class Rollouts:
    """Counted in rollouts (samples), not batches. ``accepted``/``rejected`` are verdicts on this node's
    work for a worker, or verdicts issued by this node for a validator."""

    generated: int = 0
    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    batches_submitted: int = 0
    last_rejections: tuple[Rejection, ...] = ()


@dataclass(frozen=True)
class Proofs:
    checked: int = 0
    passed: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return self.checked - self.passed

    @property
    def acceptance_rate(self) -> float | None:
        return self.passed / self.checked if self.checked else None


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float = 0.0
    tokens_total: int = 0


@dataclass(frozen=True)
class TrainPoint:
    step: int
    reward_mean: float
    pass_rate: float
    ts: float = 0.0


@dataclass(frozen=True)
class StepDiagnostics:
    """How large the trainer's last step was (``trainer/grpo.LossParts``), per completion token."""

    kl_sampler: float = 0.0
    """KL(sampler || weights before the step), nats per token."""
    clipped_frac: float = 0.0
    """Fraction of tokens the objective cut (clipped, masked or truncated: ``rl.loss``)."""
    ratio_mean: float = 1.0
    ratio_max: float = 1.0
    """pi_theta / pi_sampler over the tokens."""
    grad_norm: float = 0.0
    """Before clipping at ``rl.max_grad_norm``."""
    lr: float = 0.0
    entropy: float = 0.0
    """Mean -log pi_theta(token) on the samples: the policy's entropy estimated, nats per token."""
    staleness_max: int = 0
    """Versions the oldest sample trained was behind the weights it updated."""


@dataclass(frozen=True)
class Completion:
    """One completion as a node scored it (the trainer re-scores every rollout; a worker scores its own).
    Peer-supplied text: the board keeps it short and free of control characters."""

    ts: float
    problem_id: str
    prompt: str
    """The problem's prompt, cut to :data:`PROMPT_CHARS`."""
    text: str
    """The completion, its last :data:`COMPLETION_CHARS` characters ("…" in front when cut)."""
    answer: str | None
    """What the run's answer extraction cut out of the text; None: nothing (``reason`` says why)."""
    expected: str
    reward: float
    reason: str = ""
    """Why there is no answer: ``no_answer``, ``too_long``, ``unclosed_think``; "" when there is one."""
    policy_version: int = -1
    worker: str = ""


@dataclass(frozen=True)
class Training:
    step: int = -1
    history: tuple[TrainPoint, ...] = ()  # the newest HISTORY_LEN steps
    first: tuple[TrainPoint, ...] = ()  # the first FIRST_LEN steps this process made, kept past history
    attempts: int = 0
    """Step attempts: each time the trainer took queued batches for a step, trained on or not."""
    no_signal_attempts: int = 0
    """Attempts with no learnable group (every group's rewards equal): nothing trained, no new version."""
    no_signal_causes: dict[str, int] = field(default_factory=dict)
    """``no_signal_attempts`` by cause (:data:`NO_SIGNAL_CAUSES`)."""
    no_signal_streak: int = 0
    """The newest attempts in a row with no learnable group (0 once one trains)."""
    no_signal_since: float = 0.0
    """Wall time of the first attempt of that streak (0: no streak)."""
    groups_seen: int = 0
    """Groups in all attempts."""
    groups_filtered: int = 0
    """Of those, dropped by the online filter (rewards all equal)."""
    filtered_fraction: float | None = None
    """The last attempt's fraction of groups dropped (None before the first attempt)."""
    no_signal_warning: str = ""
    """Why the run is not learning and what to check, while it is not ("" otherwise)."""
    diagnostics: StepDiagnostics | None = None
    """The last trained step's sizes (None before one)."""
    step_warning: str = ""
    """Why the last step was too large and what to change ("" when it was in band)."""
    completions: tuple[Completion, ...] = ()
    """The newest :data:`RECENT_COMPLETIONS` completions this node scored, oldest first."""


@dataclass(frozen=True)
class Notice:
    ts: float
    level: str
    message: str


@dataclass(frozen=True)
class Health:
    """Why a node is not fully working (``reasons``, empty when it is), how often it restarted parts of
    itself (``restarts``: ``libp2p``, ``tasks``), and when its status loop last ran (0: not yet)."""

    reasons: tuple[str, ...] = ()
    restarts: dict[str, int] = field(default_factory=dict)
    refreshed_at: float = 0.0


AUDIT_STATES = ("unaudited", "passing", "partial", "failed")
"""The run's audit state as a node sees it (:class:`Audits`): no verdict heard; every step heard of
passed; some could not be audited (``unavailable``: never a pass) and none failed; a step failed."""


@dataclass(frozen=True)
class AuditFailure:
    """The first step (lowest journal sequence number) an auditor failed: its evidence in short."""

    seq: int
    version: int
    auditor: str
    expected: str
    """The policy hash the auditor's replay made."""
    published: str
    """The hash the trainer published for that step."""
    reason: str
    ts: float
    """Wall time the verdict was received (or, after a restart, the evidence was written)."""


@dataclass(frozen=True)
class Audits:
    """The run's audit state (``roles/common/audits.py``): what the run's auditors said of its trainer's
    steps, counted per step (a step several auditors judged counts once: failed if any failed it, passed
    if any passed it, else unavailable). ``refusing``: this node stopped following the trainer
    (``run.require_audits``); ``detail`` says why, or why nothing can be audited."""

    state: str = "unaudited"
    trainer: str = ""
    auditors: int = 0
    """Auditors whose verdicts this node accepts (the run's validators and ``run.auditor_peer_ids``)."""
    heard_from: int = 0
    """Of those, the ones a verdict was heard from."""
    audited: int = 0
    passed: int = 0
    failed: int = 0
    unavailable: int = 0
    last_verdict_at: float = 0.0
    """Wall time of the newest verdict accepted (0: none)."""
    first_failed: AuditFailure | None = None
    required: bool = False
    """``run.require_audits``."""
    refusing: bool = False
    detail: str = ""
    coverage: str = "off"
    """Audit coverage (``run.audit_checkpoint_every``): ``ok``, ``low`` (``coverage_detail`` says why) or
    ``off`` (no rule)."""
    coverage_gap: int = 0
    """Trained steps heard since the newest checkpoint state heard (a window's start)."""
    checkpoint_every: int = 0
    """The rule in force (``run.audit_checkpoint_every``; 0: none)."""
    coverage_detail: str = ""


@dataclass(frozen=True)
class HeldOut:
    """The newest held-out evaluation this node took (``roles/validator/evals.py``; validators only): one
    evaluator's figures for ``version`` (-1: none taken, or every one refused), and how the results this
    node heard fared."""

    version: int = -1
    n: int = 0
    pass_rate: float = 0.0
    mean_reward: float = 0.0
    evaluator: str = ""
    """The peer whose result is shown: this node when it evaluated the version, else the first heard."""
    policy: str = ""
    evaluators: int = 0
    """Results of the version taken here (not refused), from as many evaluators."""
    confirmed: int = 0
    """Results (of any version) this node evaluated again in part and found equal."""
    refused: int = 0
    """Results (of any version) refused here: re-checked and different, or not of the run's schedule,
    settings or policy; each recorded against its evaluator."""
    at: float = 0.0
    """Wall time the shown figures last changed."""


TIMELINE_STAGES = ("ready", "first_peer", "first_policy", "first_batch_submitted", "first_batch_accepted")
"""The stages of a join, in the order a fresh worker passes them (the aim: the last one within 30 s of
start on the embedded model)."""


@dataclass(frozen=True)
class Timeline:
    """Seconds from the process's start (``process_started_at``, wall time) to the first time each stage
    was reached; None until then (and for good on nodes whose roles never reach it: a validator submits
    no batch)."""

    process_started_at: float = 0.0
    ready: float | None = None
    first_peer: float | None = None
    first_policy: float | None = None
    first_batch_submitted: float | None = None
    first_batch_accepted: float | None = None

    def stages(self) -> list[tuple[str, float | None]]:
        """``(stage, seconds or None)`` in :data:`TIMELINE_STAGES` order."""
        return [(name, getattr(self, name)) for name in TIMELINE_STAGES]


def process_started_at() -> float | None:
    """Wall time at which this process started, or None where the OS does not say (not Linux).

    Linux gives a process's start in clock ticks after boot (``/proc/self/stat`` field 22, 10 ms
    resolution); the boot clock says how long ago that was. ``/proc/stat``'s ``btime`` is avoided: it is
    whole seconds, an error as large as the fast stages being measured."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - max(0.0, age)


@dataclass(frozen=True)
class StatusSnapshot:
    """One consistent view of a node. ``seq`` increases with every change on the board."""

    ts: float = 0.0
    seq: int = 0
    started_at: float = 0.0
    role: str = ""
    state: str = "starting"
    identity: Identity = field(default_factory=Identity)
    run: RunInfo = field(default_factory=RunInfo)
    peers: Peers = field(default_factory=Peers)
    reachability: Reachability = field(default_factory=Reachability)
    policy: Policy = field(default_factory=Policy)
    shards: Shards = field(default_factory=Shards)
    rollouts: Rollouts = field(default_factory=Rollouts)
    proofs: Proofs = field(default_factory=Proofs)
    throughput: Throughput = field(default_factory=Throughput)
    training: Training = field(default_factory=Training)
    warnings: tuple[Notice, ...] = ()
    health: Health = field(default_factory=Health)
    timeline: Timeline = field(default_factory=Timeline)
    audits: Audits = field(default_factory=Audits)
    held_out: HeldOut = field(default_factory=HeldOut)

    @property
    def uptime_s(self) -> float:
        return max(0.0, self.ts - self.started_at) if self.started_at else 0.0

    @property
    def healthy(self) -> bool:
        return self.state == "running" and not self.health.reasons

    @property
    def audit_age_s(self) -> float | None:
        """Seconds from the newest audit verdict accepted to this snapshot (None: none heard)."""
        at = self.audits.last_verdict_at
        return max(0.0, self.ts - at) if at else None

    @property
    def age_s(self) -> float:
        """Seconds since the node's status loop last refreshed this board (0 before it started)."""
        return max(0.0, self.ts - self.health.refreshed_at) if self.health.refreshed_at else 0.0

    def freshness(self, now: float) -> str:
        """"" if this snapshot can be shown as it is at wall time ``now``; else ``unreachable`` (a
        placeholder for a node that did not answer) or ``stale (N s)`` (old numbers)."""
        if self.state == "unreachable":
            return "unreachable"
        age = max(now - self.ts, self.age_s) if self.ts else 0.0
        return f"stale ({age:.0f} s)" if age > STALE_AFTER_S else ""

    @classmethod
    def unreachable(cls, *, role: str = "", peer_id: str = "", detail: str = "",
                    now: float | None = None) -> "StatusSnapshot":
        """What a viewer shows for a node whose status cannot be read: no numbers, the reason why."""
        return cls(ts=time.time() if now is None else now, role=role, state="unreachable",
                   identity=Identity(peer_id=peer_id),
                   health=Health(reasons=(detail or "status unreadable",)))

    def to_json(self) -> bytes:
        """JSON of :meth:`to_dict` (derived values included, so ``curl`` readers need no arithmetic)."""
        return _ENCODER.encode(self.to_dict())

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able dict, with the derived values (staleness, acceptance rate) spelled out."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["uptime_s"] = round(self.uptime_s, 3)
        out["healthy"] = self.healthy
        out["age_s"] = round(self.age_s, 3)
        out["policy"]["staleness"] = self.policy.staleness
        out["proofs"]["acceptance_rate"] = self.proofs.acceptance_rate
        out["proofs"]["failed"] = self.proofs.failed
        age = self.audit_age_s
        out["audits"]["last_verdict_age_s"] = None if age is None else round(age, 3)
        return out

    @classmethod
    def from_json(cls, data: bytes | str) -> "StatusSnapshot":
        """Strict decode (types checked; derived fields from :meth:`to_dict` and unknown fields are
        ignored, so a newer node's status still reads). Malformed input raises ProtocolError."""
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > MAX_STATUS_BYTES:
            raise ProtocolError(f"status of {len(raw)} bytes exceeds {MAX_STATUS_BYTES}")
        try:
            return _DECODER.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"not a status snapshot: {exc}") from exc


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(StatusSnapshot)

Listener = Callable[[StatusSnapshot], None]


class StatusBoard:
    """Mutable, thread-safe state behind the snapshots. ``clock`` is injectable for tests, and so is
    ``started_at``, the process's start the timeline counts from (default: :func:`process_started_at`,
    else the board's creation)."""

    def __init__(self, *, role: str = "", clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, started_at: float | None = None) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._mono = monotonic
        self._seq = 0
        now = clock()
        if started_at is None:
            started_at = process_started_at()
        origin = now if started_at is None else min(started_at, now)
        self._snap = StatusSnapshot(role=role, started_at=now, timeline=Timeline(process_started_at=origin))
        self._shards: dict[str, ShardProgress] = {}
        self._token_window: collections.deque[tuple[float, int]] = collections.deque()
        self._history: collections.deque[TrainPoint] = collections.deque(maxlen=HISTORY_LEN)
        self._first: list[TrainPoint] = []
        self._rejections: collections.deque[Rejection] = collections.deque(maxlen=RECENT_LEN)
        self._warnings: collections.deque[Notice] = collections.deque(maxlen=RECENT_LEN)
        self._failures: dict[str, int] = {}
        self._no_signal_causes: dict[str, int] = {}
        self._no_signal_hint = ""
        self._completions: collections.deque[Completion] = collections.deque(maxlen=RECENT_COMPLETIONS)
        self._degraded: dict[str, str] = {}
        self._listeners: list[Listener] = []

    # -- publishing -------------------------------------------------------------------------------

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return self._build()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(snapshot)`` after every change (on the updating thread; keep it cheap).
        Returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def _unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return _unsubscribe

    def _build(self) -> StatusSnapshot:
        s = self._snap
        now_m = self._mono()
        while self._token_window and self._token_window[0][0] < now_m - RATE_WINDOW_S:
            self._token_window.popleft()
        window_tokens = sum(n for _, n in self._token_window)
        if self._token_window:
            span = max(now_m - self._token_window[0][0], 1.0)
            rate = window_tokens / min(span, RATE_WINDOW_S)
        else:
            rate = 0.0
        active = tuple(sorted(self._shards.values(), key=lambda p: p.name))[:MAX_SHARDS_SHOWN]
        reasons = tuple(dict.fromkeys(self._degraded.values()))  # a fatal reason may come from two parts
        return dataclasses.replace(
            s, ts=self._clock(), seq=self._seq,
            state="degraded" if s.state == "running" and reasons else s.state,
            health=dataclasses.replace(s.health, reasons=reasons, restarts=dict(s.health.restarts)),
            shards=dataclasses.replace(s.shards, active=active),
            rollouts=dataclasses.replace(s.rollouts, last_rejections=tuple(self._rejections)),
            proofs=dataclasses.replace(s.proofs, failures_by_reason=dict(self._failures)),
            throughput=dataclasses.replace(s.throughput, tokens_per_s=round(rate, 3)),
            training=dataclasses.replace(s.training, history=tuple(self._history), first=tuple(self._first),
                                         no_signal_causes=dict(self._no_signal_causes),
                                         no_signal_warning=self._no_signal_warning(s.training),
                                         completions=tuple(self._completions)),
            warnings=tuple(self._warnings),
        )

    def _update(self, changes: Callable[[StatusSnapshot], dict[str, object]] | None = None) -> None:
        """Apply ``changes(current_snapshot)`` under the lock (so concurrent counters never lose an
        update), then notify listeners outside it."""
        with self._lock:
            if changes is not None:
                # A dict of field changes: replace() checks each name when it runs, mypy cannot.
                self._snap = dataclasses.replace(self._snap, **changes(self._snap))  # type: ignore[arg-type]
            self._seq += 1
            listeners = list(self._listeners)
            snap = self._build() if listeners else None
        for fn in listeners:
            assert snap is not None
            fn(snap)

    # -- setters, one per section -----------------------------------------------------------------

    def set_state(self, state: str) -> None:
        """``starting``, ``running``, ``stopping``, ``stopped`` (snapshots of a running node with degraded
        reasons read ``degraded``). The first ``running`` marks the timeline's ``ready``."""
        now = self._clock()
        self._update(lambda s: {"state": state,
                                **(self._marked(s, "ready", now) if state == "running" else {})})

    def mark(self, stage: str) -> None:
        """Stage ``stage`` (one of :data:`TIMELINE_STAGES`) was reached now; only the first call counts."""
        if stage not in TIMELINE_STAGES:
            raise ValueError(f"timeline stage {stage!r}; one of {', '.join(TIMELINE_STAGES)}")
        with self._lock:
            if getattr(self._snap.timeline, stage) is not None:
                return  # the common case (every verdict, every poll): no copy, no listeners woken
        now = self._clock()
        self._update(lambda s: self._marked(s, stage, now))

    @staticmethod
    def _marked(s: StatusSnapshot, stage: str, now: float) -> dict[str, object]:
        """The change that marks ``stage`` at wall time ``now``, or none when it was marked before."""
        tl = s.timeline
        if getattr(tl, stage) is not None:
            return {}
        since = round(max(0.0, now - tl.process_started_at), 3)
        return {"timeline": dataclasses.replace(tl, **{stage: since})}

    def set_degraded(self, key: str, reason: str) -> None:
        """Part ``key`` is not working, because ``reason``; ``reason=""`` clears it. No-op if unchanged."""
        with self._lock:
            if self._degraded.get(key, "") == reason:
                return

        def change(s: StatusSnapshot) -> dict[str, object]:
            if reason:
                self._degraded[key] = reason[:300]
            else:
                self._degraded.pop(key, None)
            return {}
        self._update(change)

    def set_restarts(self, part: str, n: int) -> None:
        """How often ``part`` (``libp2p``, ``tasks``) was restarted since the node started."""
        self._update(lambda s: {"health": dataclasses.replace(s.health, restarts={**s.health.restarts,
                                                                                   part: n})})

    def refreshed(self) -> None:
        """The runtime's status loop ran (its absence for a few seconds makes the snapshot stale)."""
        now = self._clock()
        self._update(lambda s: {"health": dataclasses.replace(s.health, refreshed_at=now)})

    def set_identity(self, peer_id: str, *, version: str = "", data_dir: str = "",
                     listen_addrs: Iterable[str] = (), http_url: str = "") -> None:
        ident = Identity(peer_id=peer_id, version=version, data_dir=data_dir,
                         listen_addrs=tuple(listen_addrs), http_url=http_url)
        self._update(lambda s: {"identity": dataclasses.replace(ident, metrics_url=s.identity.metrics_url)})

    def set_audits(self, audits: Audits) -> None:
        """The run's audit state, whole (``roles/common/audits.py`` owns it)."""
        if audits.state not in AUDIT_STATES:
            raise ValueError(f"audit state {audits.state!r}; one of {', '.join(AUDIT_STATES)}")
        self._update(lambda s: {"audits": audits})

    def set_held_out(self, held: HeldOut) -> None:
        """The newest held-out evaluation, whole (``roles/validator/evals.py`` owns it)."""
        self._update(lambda s: {"held_out": held})

    def set_metrics_url(self, url: str) -> None:
        """Where ``/metrics`` is served (its port may be a fallback): the dashboard shows it."""
        self._update(lambda s: {"identity": dataclasses.replace(s.identity, metrics_url=url)})

    def set_run(self, run_id: str, *, model: str = "", dtype: str = "", trainer_peer_id: str = "",
                async_level: int = 0) -> None:
        run = RunInfo(run_id=run_id, model=model, dtype=dtype, trainer_peer_id=trainer_peer_id,
                      async_level=async_level)
        self._update(lambda s: {"run": run})

    def set_peers(self, count: int, *, trainers: Iterable[str] = (), validators: Iterable[str] = (),
                  workers: Iterable[str] = ()) -> None:
        now = self._clock()
        self._update(lambda s: {"peers": replace(s.peers, count=count, trainers=tuple(sorted(trainers)),
                                                 validators=tuple(sorted(validators)),
                                                 workers=tuple(sorted(workers))),
                                **(self._marked(s, "first_peer", now) if count > 0 else {})})

    def set_inbound(self, in_use: int, cap: int, refused: int) -> None:
        """The inbound connection cap (see :class:`Peers`)."""
        self._update(lambda s: {"peers": replace(s.peers, inbound_in_use=in_use, inbound_cap=cap,
                                                 inbound_refused=refused)})

    def set_gossip(self, *, refused: int, stale: int, repeat: int) -> None:
        """Gossip messages not delivered so far (see :class:`Peers`)."""
        self._update(lambda s: {"peers": replace(s.peers, gossip_refused=refused, gossip_ignored_stale=stale,
                                                 gossip_ignored_repeat=repeat)})

    def set_reachability(self, status: str, *, public_addrs: Iterable[str] = (), relay: str = "",
                         detail: str = "") -> None:
        status = str(getattr(status, "value", status)).lower()  # AutoNAT's enum says "PUBLIC"
        if status not in ("unknown", "public", "private", "relayed"):
            raise ValueError(f"reachability status {status!r}")
        reach = Reachability(status=status, public_addrs=tuple(public_addrs), relay=relay, detail=detail)
        self._update(lambda s: {"reachability": reach})

    def set_policy(self, *, current: int | None = None, local: int | None = None) -> None:
        """Either side may be given alone; ``current`` never goes backwards and is at least ``local``."""
        now = self._clock()

        def change(s: StatusSnapshot) -> dict[str, object]:
            p = s.policy
            new_local = p.local if local is None else local
            new_current = p.current if current is None else max(p.current, current)
            held = self._marked(s, "first_policy", now) if new_local >= 0 else {}
            return {"policy": Policy(current=max(new_current, new_local), local=new_local, updated_at=now),
                    **held}
        self._update(change)

    def shard_progress(self, cid: str, name: str, bytes_done: int, bytes_total: int,
                       *, new_bytes: int = 0) -> None:
        """Report a download in progress; ``new_bytes`` is what arrived since the last call."""
        def change(s: StatusSnapshot) -> dict[str, object]:
            self._shards[cid] = ShardProgress(name=name, cid=cid, bytes_done=bytes_done,
                                              bytes_total=bytes_total)
            return {"shards": dataclasses.replace(s.shards,
                                                  bytes_downloaded=s.shards.bytes_downloaded + new_bytes)}
        self._update(change)

    def shard_done(self, cid: str, *, new_bytes: int = 0) -> None:
        def change(s: StatusSnapshot) -> dict[str, object]:
            self._shards.pop(cid, None)
            return {"shards": dataclasses.replace(s.shards,
                                                  bytes_downloaded=s.shards.bytes_downloaded + new_bytes,
                                                  completed=s.shards.completed + 1)}
        self._update(change)

    def rollouts_generated(self, n: int, *, tokens: int = 0) -> None:
        def change(s: StatusSnapshot) -> dict[str, object]:
            if tokens:
                self._token_window.append((self._mono(), tokens))
            return {"rollouts": dataclasses.replace(s.rollouts, generated=s.rollouts.generated + n),
                    "throughput": dataclasses.replace(s.throughput,
                                                      tokens_total=s.throughput.tokens_total + tokens)}
        self._update(change)

    def rollouts_submitted(self, n: int) -> None:
        self._update(lambda s: {"rollouts": dataclasses.replace(
            s.rollouts, submitted=s.rollouts.submitted + n,
            batches_submitted=s.rollouts.batches_submitted + 1)})

    def verdict(self, accepted: bool, n: int = 1, *, reason: str = "", detail: str = "",
                peer: str = "") -> None:
        """Count ``n`` rollouts accepted or rejected; a rejection's reason goes to the recent list."""
        now = self._clock()

        def change(s: StatusSnapshot) -> dict[str, object]:
            r = s.rollouts
            if accepted:
                return {"rollouts": dataclasses.replace(r, accepted=r.accepted + n)}
            self._rejections.append(Rejection(ts=now, reason=reason or "rejected", detail=detail[:200],
                                              peer=peer))
            return {"rollouts": dataclasses.replace(r, rejected=r.rejected + n)}
        self._update(change)

    def proof_checked(self, passed: bool, *, reason: str = "") -> None:
        def change(s: StatusSnapshot) -> dict[str, object]:
            if not passed:
                key = reason or "unknown"
                self._failures[key] = self._failures.get(key, 0) + 1
            return {"proofs": dataclasses.replace(s.proofs, checked=s.proofs.checked + 1,
                                                  passed=s.proofs.passed + int(passed))}
        self._update(change)

    def train_step(self, step: int, *, reward_mean: float, pass_rate: float,
                   diagnostics: StepDiagnostics | None = None, step_warning: str = "") -> None:
        point = TrainPoint(step=step, reward_mean=float(reward_mean), pass_rate=float(pass_rate),
                           ts=self._clock())

        def change(s: StatusSnapshot) -> dict[str, object]:
            self._history.append(point)
            if len(self._first) < FIRST_LEN:
                self._first.append(point)
            return {"training": dataclasses.replace(s.training, step=step, step_warning=step_warning[:400],
                                                    diagnostics=diagnostics or s.training.diagnostics)}
        self._update(change)

    def train_attempt(self, *, groups: int, filtered: int, cause: str = "", hint: str = "") -> None:
        """The trainer took batches for a step: ``groups`` groups, ``filtered`` of them dropped by the
        online filter. ``cause`` (one of :data:`NO_SIGNAL_CAUSES`) when no group was learnable, with
        ``hint``, what the warning says about it; "" when the attempt trained."""
        if cause and cause not in NO_SIGNAL_CAUSES:
            raise ValueError(f"no-signal cause {cause!r}; one of {', '.join(NO_SIGNAL_CAUSES)}")
        now = self._clock()

        def change(s: StatusSnapshot) -> dict[str, object]:
            t = s.training
            if cause:
                self._no_signal_causes[cause] = self._no_signal_causes.get(cause, 0) + 1
                self._no_signal_hint = hint[:400]
            return {"training": dataclasses.replace(
                t, attempts=t.attempts + 1, no_signal_attempts=t.no_signal_attempts + int(bool(cause)),
                no_signal_streak=t.no_signal_streak + 1 if cause else 0,
                no_signal_since=(t.no_signal_since or now) if cause else 0.0,
                groups_seen=t.groups_seen + groups, groups_filtered=t.groups_filtered + filtered,
                filtered_fraction=filtered / groups if groups else 1.0)}
        self._update(change)

    def _no_signal_warning(self, t: Training) -> str:
        """The warning for a streak of unlearnable attempts, once it is long or old enough ("" else)."""
        streak = t.no_signal_streak
        young = self._clock() - t.no_signal_since < NO_SIGNAL_WINDOW_S
        if not streak or (streak < NO_SIGNAL_ATTEMPTS and young):
            return ""
        steps = "step attempt" if streak == 1 else f"{streak} step attempts"
        return f"no learnable group in the last {steps}: {self._no_signal_hint}"

    def completions(self, items: Iterable[Completion]) -> None:
        """Completions this node just scored (the newest :data:`RECENT_COMPLETIONS` are kept); their text
        is cut and cleaned here (:func:`clean_text`)."""
        cleaned = [dataclasses.replace(
            c, problem_id=clean_text(c.problem_id, ANSWER_CHARS), prompt=clean_text(c.prompt, PROMPT_CHARS),
            text=clean_text(c.text, COMPLETION_CHARS, keep="tail"),
            answer=None if c.answer is None else clean_text(c.answer, ANSWER_CHARS),
            expected=clean_text(c.expected, ANSWER_CHARS), reason=clean_text(c.reason, ANSWER_CHARS),
            worker=clean_text(c.worker, ANSWER_CHARS), reward=float(c.reward)) for c in items]
        if not cleaned:
            return

        def change(s: StatusSnapshot) -> dict[str, object]:
            self._completions.extend(cleaned)
            return {}
        self._update(change)

    def warn(self, message: str, *, level: str = "WARNING") -> None:
        notice = Notice(ts=self._clock(), level=level, message=message[:300])

        def change(s: StatusSnapshot) -> dict[str, object]:
            self._warnings.append(notice)
            return {}
        self._update(change)


def clean_text(text: str, limit: int, *, keep: str = "head") -> str:
    """``text`` on one line, without control characters (C0, DEL, C1: a terminal escape in a peer's
    completion must not reach a viewer's screen), cut to ``limit`` characters with "…" where it was cut:
    its start kept (``keep="head"``) or its end (``"tail"``)."""
    flat = "".join(" " if ch in "\t\n\r" else ch for ch in text
                   if ch in "\t\n\r" or not (ord(ch) < 32 or 127 <= ord(ch) < 160))
    flat = " ".join(flat.split())  # newlines and runs of spaces read as one space on one line
    if len(flat) <= limit:
        return flat
    return "…" + flat[len(flat) - limit + 1:] if keep == "tail" else flat[:limit - 1] + "…"


class BoardLogHandler(logging.Handler):
    """Forward WARNING and above to ``board.warn`` so the dashboard shows them."""

    def __init__(self, board: StatusBoard, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._board = board

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._board.warn(record.getMessage(), level=record.levelname)
        except Exception:  # a log handler must never raise into the code that logged
            self.handleError(record)
