"""The operator's ledger: every rollout batch this node submitted and every verdict it received.

SQLite in WAL mode with ``synchronous=FULL``: each ``record_*`` call commits (fsync) before it returns,
so the caller persists first and acknowledges/publishes after (the contract in docs/architecture.md).
WAL lets ``intellect-node ledger`` read while the node writes.

A verdict is keyed by (batch, validator): gossip may deliver the same verdict twice, and recording it
again changes nothing. A verdict for a batch this node never submitted is still recorded (it may come
from before a crash that lost nothing but the ack) and shows up as ``unknown_batch_verdicts``.

The file and its ``-wal``/``-shm`` companions are 0600: it names every peer this node worked with. SQLite
gives the companions the main file's mode, so the main file is created 0600 before SQLite opens it (and
tightened, with its companions, when an older version left them readable by others).

Calls block for one fsync (about a millisecond on an SSD); the roles call them from a worker thread
(``asyncio.to_thread``) when that matters. One connection guarded by a lock serves all threads.

In a node, :class:`LedgerService` (added by ``join`` before the roles, so it closes after them) opens the
ledger at construction; a role finds it with ``roles.common.services.ledger_of(runtime)``. Closing it
checkpoints the WAL into the main file: after a clean stop (SIGTERM) ``ledger.sqlite`` alone holds everything.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, TypedDict

from intellect_node.errors import ConfigError
from intellect_node.fsutil import ensure_private_file

LEDGER_FILE = "ledger.sqlite"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    batch_id       TEXT PRIMARY KEY,
    run_id         TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    n_rollouts     INTEGER NOT NULL,
    n_tokens       INTEGER NOT NULL,
    cid            TEXT NOT NULL DEFAULT '',
    submitted_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS verdicts (
    batch_id     TEXT NOT NULL,
    validator    TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    n_accepted   INTEGER NOT NULL,
    n_rejected   INTEGER NOT NULL,
    reason       TEXT NOT NULL DEFAULT '',
    detail       TEXT NOT NULL DEFAULT '',
    step         INTEGER NOT NULL DEFAULT -1,
    received_at  REAL NOT NULL,
    PRIMARY KEY (batch_id, validator)
);
CREATE INDEX IF NOT EXISTS verdicts_received ON verdicts(received_at);
CREATE TABLE IF NOT EXISTS trained (
    run_id           TEXT NOT NULL,
    batch_id         TEXT NOT NULL,
    worker           TEXT NOT NULL,
    seq              INTEGER NOT NULL,
    step             INTEGER NOT NULL,
    version          INTEGER NOT NULL,
    outcome          TEXT NOT NULL,
    groups           INTEGER NOT NULL,
    groups_trained   INTEGER NOT NULL,
    rollouts_trained INTEGER NOT NULL,
    received_at      REAL NOT NULL,
    PRIMARY KEY (run_id, batch_id)
);
CREATE INDEX IF NOT EXISTS trained_worker ON trained(worker);
CREATE TABLE IF NOT EXISTS heads (
    run_id       TEXT PRIMARY KEY,
    base_version INTEGER NOT NULL,
    async_level  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_submitted ON batches(submitted_at);
"""


TRAINED_OUTCOMES = ("trained", "equal_rewards", "stale", "duplicate", "wrong_task", "not_assigned",
                    "bad_signature", "refused", "banned", "not_allowed", "unavailable")
"""What a step record says of a batch it names: trained on (some of its groups at least), every group's
rewards equal (nothing to learn from), refused as stale (its rollouts older than ``run.async_level``), or
dropped by the trainer before queuing it for another reason (``protocol.steps.DROP_REASONS``)."""
UNRECORDED_SLACK_VERSIONS = 1
"""An accepted batch of policy version v that no step record names counts as dropped without a record once
a record's base version reaches v + ``run.async_level`` + 1 (its rollouts are stale there, so an honest
trainer has named it) plus this many versions (its admission may have been under way over a step)."""


@dataclass(frozen=True)
class Receipt:
    """One batch named in a trainer's signed step record (``protocol/steps.py``)."""

    batch_id: str
    worker: str
    outcome: str  # one of TRAINED_OUTCOMES
    groups: int
    groups_trained: int
    rollouts_trained: int


@dataclass(frozen=True)
class LedgerSummary:
    batches_submitted: int = 0
    rollouts_submitted: int = 0
    tokens_submitted: int = 0
    verdicts_received: int = 0
    rollouts_accepted: int = 0
    rollouts_rejected: int = 0
    batches_pending: int = 0
    unknown_batch_verdicts: int = 0
    rejection_reasons: dict[str, int] = field(default_factory=dict)
    runs: tuple[str, ...] = ()
    first_at: float | None = None
    last_at: float | None = None
    batches_trained: int = 0
    """This node's batches a step record says were trained on (receipts)."""
    rollouts_trained: int = 0
    batches_admitted_untrained: int = 0
    """Accepted by every verdict heard and named by no step record yet, still trainable."""
    batches_unrecorded: int = 0
    """Accepted by every verdict heard and named by no step record though past the staleness bound
    (:data:`UNRECORDED_SLACK_VERSIONS`): dropped without a record."""
    batches_dropped: dict[str, int] = field(default_factory=dict)
    """This node's batches a step record took without training on them, by outcome."""

    @property
    def acceptance_rate(self) -> float | None:
        judged = self.rollouts_accepted + self.rollouts_rejected
        return self.rollouts_accepted / judged if judged else None

    def to_dict(self) -> dict[str, object]:
        return {
            "batches_submitted": self.batches_submitted, "rollouts_submitted": self.rollouts_submitted,
            "tokens_submitted": self.tokens_submitted, "verdicts_received": self.verdicts_received,
            "rollouts_accepted": self.rollouts_accepted, "rollouts_rejected": self.rollouts_rejected,
            "batches_pending": self.batches_pending, "unknown_batch_verdicts": self.unknown_batch_verdicts,
            "acceptance_rate": self.acceptance_rate, "rejection_reasons": dict(self.rejection_reasons),
            "runs": list(self.runs), "first_at": self.first_at, "last_at": self.last_at,
            "batches_trained": self.batches_trained, "rollouts_trained": self.rollouts_trained,
            "batches_admitted_untrained": self.batches_admitted_untrained,
            "batches_unrecorded": self.batches_unrecorded,
            "batches_dropped": dict(self.batches_dropped),
        }


_PAST_BOUND = ("coalesce((SELECT h.base_version >= b.policy_version + h.async_level + 1 + "
               f"{UNRECORDED_SLACK_VERSIONS} FROM heads h WHERE h.run_id = b.run_id), 0)")
"""SQL: 1 when the step records heard for batch ``b``'s run are past the version its rollouts could be
trained at (with the slack), else 0."""


class Ledger:
    """Open (creating if needed) the ledger at ``path``. ``readonly`` opens an existing file for queries."""

    def __init__(self, path: str | Path, *, readonly: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        try:
            if readonly:
                if not self.path.exists():
                    raise ConfigError(f"no ledger at {self.path}; a node writes one once it submits work "
                                      "(check --data-dir)", field="data_dir")
                # A read-write handle made query-only rather than mode=ro: a mode=ro reader cannot remove
                # the -wal/-shm files it creates, so every `ledger` run would leave two files behind.
                self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                self._db.execute("PRAGMA query_only=ON")
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                for suffix in ("", "-wal", "-shm"):
                    companion = self.path.with_name(self.path.name + suffix)
                    if not suffix or companion.exists():
                        ensure_private_file(companion)
                self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version == 0:
                    self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                elif version != SCHEMA_VERSION:
                    raise ConfigError(f"{self.path} has ledger schema {version}, this node reads "
                                      f"{SCHEMA_VERSION}; move it aside", field="data_dir")
            self._db.execute("SELECT count(*) FROM batches").fetchone()
            # A ledger written before receipts existed has no table for them (a node adds it when it opens
            # the file): a reader then shows none.
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            self._receipts = "trained" in tables
            self._past_bound = _PAST_BOUND if "heads" in tables else "0"  # an older file: none known
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path} is not a readable ledger ({exc}); move it aside and the node "
                              "starts a new one", field="data_dir") from exc
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot create the ledger ({exc.strerror}); check the owner and "
                              "mode of --data-dir", field="data_dir") from exc

    @classmethod
    def in_data_dir(cls, data_dir: Path, *, readonly: bool = False,
                    clock: Callable[[], float] = time.time) -> "Ledger":
        return cls(data_dir / LEDGER_FILE, readonly=readonly, clock=clock)

    # -- writes (each commits durably before returning) ---------------------------------------------

    def record_submission(self, batch_id: str, *, run_id: str, policy_version: int, n_rollouts: int,
                          n_tokens: int, cid: str = "") -> bool:
        """Record a batch before it is published. False if it was already recorded (a resubmission)."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO batches VALUES (?, ?, ?, ?, ?, ?, ?)",
                (batch_id, run_id, int(policy_version), int(n_rollouts), int(n_tokens), cid, self._clock()))
            return cur.rowcount == 1

    def record_verdict(self, batch_id: str, *, validator: str, run_id: str, n_accepted: int, n_rejected: int,
                       reason: str = "", detail: str = "", step: int = -1) -> bool:
        """Record a verdict before acting on it. False if this validator's verdict was already there."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO verdicts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, validator, run_id, int(n_accepted), int(n_rejected), reason, detail[:500],
                 int(step), self._clock()))
            return cur.rowcount == 1

    def record_step(self, *, run_id: str, seq: int, step: int, version: int,
                    receipts: list[Receipt], base_version: int = 0, async_level: int = 0) -> int:
        """Record the batches one step record names (the receipts of every worker it names); how many were
        new. A batch keeps the first record that named it (a replayed step names the same). The run's
        newest ``base_version`` heard and its ``run.async_level`` say which accepted batches no record
        named in time (:data:`UNRECORDED_SLACK_VERSIONS`)."""
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                n = 0
                for r in receipts:
                    n += self._db.execute(
                        "INSERT OR IGNORE INTO trained VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (run_id, r.batch_id, r.worker, int(seq), int(step), int(version), r.outcome,
                         int(r.groups), int(r.groups_trained), int(r.rollouts_trained), now)).rowcount
                self._db.execute(
                    "INSERT INTO heads VALUES (?, ?, ?) ON CONFLICT(run_id) DO UPDATE SET "
                    "base_version = max(base_version, excluded.base_version), "
                    "async_level = excluded.async_level", (run_id, int(base_version), int(async_level)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return n

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close (called on shutdown)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.OperationalError:
                pass  # read-only connections cannot checkpoint; nothing to flush
            self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries --------------------------------------------------------------------------------------

    def summary(self, *, run_id: str | None = None) -> LedgerSummary:
        """Totals over the whole ledger, or over one run."""
        # "(? IS NULL OR run_id = ?)" selects everything when run_id is None.
        a = (run_id, run_id)
        with self._lock:
            db = self._db
            nb, nr, nt, b_first, b_last = db.execute(
                "SELECT count(*), coalesce(sum(n_rollouts),0), coalesce(sum(n_tokens),0), min(submitted_at), "
                "max(submitted_at) FROM batches WHERE (? IS NULL OR run_id = ?)", a).fetchone()
            nv, na, nrej, v_last = db.execute(
                "SELECT count(*), coalesce(sum(n_accepted),0), coalesce(sum(n_rejected),0), max(received_at) "
                "FROM verdicts WHERE (? IS NULL OR run_id = ?)", a).fetchone()
            pending = db.execute(
                "SELECT count(*) FROM batches b WHERE (? IS NULL OR b.run_id = ?) "
                "AND NOT EXISTS (SELECT 1 FROM verdicts v WHERE v.batch_id = b.batch_id)", a).fetchone()[0]
            unknown = db.execute(
                "SELECT count(*) FROM verdicts v WHERE (? IS NULL OR v.run_id = ?) "
                "AND NOT EXISTS (SELECT 1 FROM batches b WHERE b.batch_id = v.batch_id)", a).fetchone()[0]
            reasons = db.execute(
                "SELECT reason, sum(n_rejected) FROM verdicts WHERE (? IS NULL OR run_id = ?) "
                "AND n_rejected > 0 GROUP BY reason ORDER BY 2 DESC, 1", a).fetchall()
            runs = tuple(r[0] for r in db.execute(
                "SELECT run_id FROM batches UNION SELECT run_id FROM verdicts ORDER BY 1").fetchall())
            trained, rollouts, untrained, unrecorded, dropped = 0, 0, 0, 0, []
            if self._receipts:
                trained, rollouts = db.execute(
                    "SELECT count(*), coalesce(sum(t.rollouts_trained),0) FROM trained t JOIN batches b "
                    "ON b.batch_id = t.batch_id WHERE (? IS NULL OR t.run_id = ?) AND t.outcome = 'trained'",
                    a).fetchone()
                dropped = db.execute(
                    "SELECT t.outcome, count(*) FROM trained t JOIN batches b ON b.batch_id = t.batch_id "
                    "WHERE (? IS NULL OR t.run_id = ?) AND t.outcome != 'trained' GROUP BY 1 ORDER BY 1",
                    a).fetchall()
                untrained, unrecorded = db.execute(
                    f"SELECT count(*) - coalesce(sum({self._past_bound}), 0), "
                    f"coalesce(sum({self._past_bound}), 0) "
                    "FROM batches b WHERE (? IS NULL OR b.run_id = ?) "
                    "AND EXISTS (SELECT 1 FROM verdicts v WHERE v.batch_id = b.batch_id) "
                    "AND NOT EXISTS (SELECT 1 FROM verdicts v WHERE v.batch_id = b.batch_id "
                    "AND (v.n_rejected > 0 OR v.n_accepted = 0)) "
                    "AND NOT EXISTS (SELECT 1 FROM trained t WHERE t.batch_id = b.batch_id)", a).fetchone()
        times = [t for t in (b_first, b_last, v_last) if t is not None]
        return LedgerSummary(
            batches_submitted=nb, rollouts_submitted=nr, tokens_submitted=nt, verdicts_received=nv,
            rollouts_accepted=na, rollouts_rejected=nrej, batches_pending=pending,
            unknown_batch_verdicts=unknown, rejection_reasons={(k or "rejected"): v for k, v in reasons},
            runs=runs, first_at=min(times) if times else None, last_at=max(times) if times else None,
            batches_trained=trained, rollouts_trained=rollouts, batches_admitted_untrained=untrained,
            batches_unrecorded=unrecorded, batches_dropped=dict(dropped))

    def recent(self, limit: int = 20) -> list[BatchRow]:
        """The newest batches with their verdicts and receipt (``trained_*``: what the step record naming
        the batch says; None when none has; ``past_bound``: no record named it, though the records heard
        are past the version it could be trained at), newest first."""
        receipt = (f"t.outcome, t.version, t.step, t.groups_trained, t.groups, {self._past_bound}"
                   if self._receipts else "NULL, NULL, NULL, NULL, NULL, 0")
        join = "LEFT JOIN trained t ON t.batch_id = b.batch_id " if self._receipts else ""
        with self._lock:
            rows = self._db.execute(
                "SELECT b.batch_id, b.run_id, b.policy_version, b.n_rollouts, b.n_tokens, b.submitted_at, "
                "coalesce(sum(v.n_accepted),0), coalesce(sum(v.n_rejected),0), count(v.batch_id), "
                f"group_concat(nullif(v.reason,''), ','), {receipt} "
                f"FROM batches b LEFT JOIN verdicts v ON v.batch_id = b.batch_id {join}"
                "GROUP BY b.batch_id ORDER BY b.submitted_at DESC, b.rowid DESC LIMIT ?",
                (int(limit),)).fetchall()
        return [BatchRow(batch_id=r[0], run_id=r[1], policy_version=r[2], n_rollouts=r[3], n_tokens=r[4],
                         submitted_at=r[5], accepted=r[6], rejected=r[7], verdicts=r[8], reasons=r[9],
                         trained_outcome=r[10], trained_version=r[11], trained_step=r[12],
                         trained_groups=r[13], groups=r[14], past_bound=r[15]) for r in rows]

    def trained_by_worker(self, *, run_id: str | None = None) -> list[WorkerTrained]:
        """Every worker the step records this node heard name: batches trained, rollouts trained, batches
        dropped (equal rewards, stale); most rollouts trained first. From the records alone."""
        if not self._receipts:
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT worker, sum(outcome = 'trained'), coalesce(sum(rollouts_trained),0), "
                "sum(outcome = 'equal_rewards'), sum(outcome = 'stale'), max(version) FROM trained "
                "WHERE (? IS NULL OR run_id = ?) GROUP BY worker ORDER BY 3 DESC, 1",
                (run_id, run_id)).fetchall()
        return [WorkerTrained(worker=r[0], batches_trained=r[1], rollouts_trained=r[2], equal_rewards=r[3],
                              stale=r[4], last_version=r[5]) for r in rows]


class BatchRow(TypedDict):
    """One batch this node submitted (:meth:`Ledger.recent`): its verdicts summed, and what the step record
    naming it says (``trained_*`` and ``groups``: None when no record named it)."""

    batch_id: str
    run_id: str
    policy_version: int
    n_rollouts: int
    n_tokens: int
    submitted_at: float
    accepted: int
    rejected: int
    verdicts: int
    reasons: str | None
    """The validators' reasons, comma-separated; None when none gave one."""
    trained_outcome: str | None
    trained_version: int | None
    trained_step: int | None
    trained_groups: int | None
    groups: int | None
    past_bound: int
    """1 when no record named the batch though the records heard are past the version it could be trained
    at, else 0."""


class WorkerTrained(TypedDict):
    """One worker as the step records heard name it (:meth:`Ledger.trained_by_worker`)."""

    worker: str
    batches_trained: int
    rollouts_trained: int
    equal_rewards: int
    stale: int
    last_version: int


class _HasDataDir(Protocol):
    @property
    def data_dir(self) -> Path: ...


class LedgerService:
    """The node's ledger as a runtime service (see ``node/runtime.py``)."""

    name = "ledger"

    def __init__(self, data_dir: Path) -> None:
        self.ledger = Ledger.in_data_dir(data_dir)

    @classmethod
    def for_runtime(cls, rt: _HasDataDir) -> "LedgerService":
        return cls(rt.data_dir)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self.ledger.close()

    def status(self) -> dict[str, object]:
        return self.ledger.summary().to_dict()
