"""The run's audit coverage (``run.audit_checkpoint_every``, ``roles/common/audits.Coverage``): what every
node makes of the trainer's step records and the auditors' verdicts about window starts.

The rule on constructed signed records, through the watch's gossip validators and handlers as the swarm
would run them: a trainer that never publishes ``state`` reads ``low`` after the rule's steps and the
grace, and with ``run.require_audits`` the node refuses it as its own reason, lifted once a checkpoint
state is heard; an honest trainer reads ``ok`` at every record, heard in order or out of it, and on a
node that joins late; starts the auditors could not fetch read ``low`` after :data:`START_STREAK` in a
row, not when a step after them passed nor for a start the trainer no longer has to serve. The views
(status JSON, ``/metrics``, the dashboard, ``intellect-node status``) and the setting (schema, manifest).
The real trainer keeping the rule whatever its ``rl.checkpoint_every``, and a worker refusing one that
does not, are in ``test_audit_coverage_run.py``.
"""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from rich.console import Console

from intellect_node import dashboard
from intellect_node.commands.status import summary
from intellect_node.config import build_config
from intellect_node.config.run_manifest import run_sections
from intellect_node.config.schema import REQUIRED_AUDIT_CHECKPOINT_EVERY
from intellect_node.config.status import StatusBoard, StatusSnapshot
from intellect_node.errors import ConfigError
from intellect_node.node.metrics import build_registry
from intellect_node.protocol.audits import AUDIT_KIND, AuditVerdict, seal_verdict
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.steps import (
    STEP_KIND,
    StepBatch,
    StepRecord,
    StepSettings,
    StepState,
    seal_record,
)
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.audits import (
    COVERAGE_GRACE_STEPS,
    START_REASON,
    START_STREAK,
    AuditWatch,
    Coverage,
    audit_gate,
)
from intellect_node.roles.common.pins import GC_MIN_AGE_S, PINNED_STATES
from tests.support.peerbook import Peerbook

RUN = "cover"
TRAINER, AUDITOR, WORKER = (SigningKey(bytes([70 + i]) * 32) for i in range(3))
SETTINGS = StepSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, group_size=2, clip_eps_low=0.2,
                        clip_eps_high=0.2, neg_ratio_cap=1.0, max_grad_norm=1.0, token_budget=100,
                        kl_coef=0.0, entropy_coef=0.0, scale_by_std=True, temperature=1.0, micro_tokens=None,
                        compute_dtype=None)
EVERY = 3
LIMIT = EVERY + COVERAGE_GRACE_STEPS  # the largest gap that still reads ok


def h(v: int) -> str:
    return cid_of(f"weights v{v}".encode())


def rec(seq: int, step: int, *, state: bool = False, trained: bool = True) -> StepRecord:
    """Record ``seq`` of a trainer at trained step ``step`` (version = step), with ``state`` or not."""
    batch = StepBatch(cid=cid_of(f"batch {seq}".encode()), worker=WORKER.peer_id, groups=2,
                      trained=[0] if trained else [])
    base = step - 1 if trained else step
    st_ = StepState(weights_cid=cid_of(f"w{step}".encode()), optimizer_cid=cid_of(f"o{step}".encode()),
                    optimizer_hash=cid_of(f"oh{step}".encode())) if state else None
    return StepRecord(run_id=RUN, seq=seq, step=step, base_version=base, base_hash=h(base), version=step,
                      checkpoint_hash=h(step), batches=[batch], settings=SETTINGS,
                      no_signal="" if trained else "all_equal", state=st_)


def honest(steps: int, every: int = EVERY, *, no_signal_every: int = 4) -> list[StepRecord]:
    """An honest trainer's records: a state every ``every`` trained steps, a step with nothing to learn
    from now and then (no new version, no state)."""
    out: list[StepRecord] = []
    step = 0
    while step < steps:
        seq = len(out) + 1
        if seq % no_signal_every == 0:
            out.append(rec(seq, step, trained=False))
            continue
        step += 1
        out.append(rec(seq, step, state=step % every == 0))
    return out


def start_verdict(seq: int, version: int, outcome: str = "unavailable") -> AuditVerdict:
    return AuditVerdict(run_id=RUN, trainer=TRAINER.peer_id, seq=seq, version=version,
                        outcome=outcome,  # type: ignore[arg-type]
                        published=cid_of(f"oh{version}".encode()),
                        reason=f"{START_REASON} v{version} not fetched: no provider answered")


def step_verdict(seq: int, version: int) -> AuditVerdict:
    return AuditVerdict(run_id=RUN, trainer=TRAINER.peer_id, seq=seq, version=version, outcome="pass",
                        published=h(version), expected=h(version))


# -- the rule, pure -----------------------------------------------------------------------------------

def test_a_trainer_that_never_publishes_state_reads_low_after_the_rule_and_the_grace() -> None:
    c = Coverage(EVERY)
    for step in range(1, LIMIT + 1):
        c.record(rec(step, step), 0.0)
        assert c.state == "ok" and c.gap == step, (step, c.low)
    c.record(rec(LIMIT + 1, LIMIT + 1), 0.0)
    assert c.state == "low" and c.gap == LIMIT + 1
    assert "without a checkpoint state" in c.low and "run.audit_checkpoint_every is 3" in c.low
    c.record(rec(LIMIT + 2, LIMIT + 2, state=True), 0.0)  # a state at last: back
    assert c.state == "ok" and c.gap == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=2.99), min_size=60, max_size=60),
       st.integers(min_value=1, max_value=6))
def test_an_honest_trainer_reads_ok_at_every_record_in_or_out_of_order(late: list[float], every: int) -> None:
    """Each record heard up to two places after where it was published (a checkpoint's record after the
    next two steps', whose state blobs took time): never low."""
    records = honest(45, every)
    heard = [r for _, r in sorted(zip((i + late[i] for i in range(len(records))), records),
                                  key=lambda p: p[0])]
    c = Coverage(every)
    for r in heard:
        c.record(r, 0.0)
        assert c.state == "ok", (every, [x.seq for x in heard], c.low)
    assert c.gap < every


def test_a_node_that_joins_late_measures_from_the_first_record_it_hears() -> None:
    c = Coverage(EVERY)
    for i, step in enumerate(range(500, 500 + LIMIT)):  # the state before step 500 was not heard here
        c.record(rec(900 + i, step), 0.0)
        assert c.state == "ok", c.low
    c.record(rec(900 + LIMIT, 500 + LIMIT), 0.0)
    assert c.state == "low"


def test_no_rule_is_off_and_the_gap_still_shown() -> None:
    c = Coverage(0)
    for step in range(1, 50):
        c.record(rec(step, step), 0.0)
    assert (c.state, c.low, c.gap) == ("off", "", 49)


def test_starts_the_auditors_could_not_fetch_read_low_after_a_streak() -> None:
    c = Coverage(EVERY)
    for r in honest(30):
        c.record(r, 100.0)
    starts = [r for r in honest(30) if r.state is not None][-START_STREAK:]
    for r in starts:
        assert c.state == "ok", c.low
        c.verdict(start_verdict(r.seq, r.version), 100.0)
        c.verdict(start_verdict(r.seq, r.version), 100.0)  # a second auditor's word: one start
    assert c.state == "low" and f"last {START_STREAK} window starts" in c.low and START_REASON in c.low
    c.verdict(step_verdict(starts[-1].seq + 1, starts[-1].version + 1), 100.0)  # a step after them passed
    assert c.state == "ok" and not c.unfetched


def test_a_pass_between_unfetched_starts_breaks_the_streak_and_other_unavailables_do_not_count() -> None:
    c = Coverage(EVERY)
    records = honest(40)
    for r in records:
        c.record(r, 0.0)
    starts = [r for r in records if r.state is not None]
    c.verdict(start_verdict(starts[0].seq, starts[0].version), 0.0)
    c.verdict(step_verdict(starts[1].seq, starts[1].version), 0.0)  # the window from elsewhere got past it
    for r in starts[1:START_STREAK]:
        c.verdict(start_verdict(r.seq, r.version), 0.0)
    assert c.state == "ok" and len(c.unfetched) == START_STREAK - 1
    for r in records[-5:]:  # a batch not to be had is the worker's, not the trainer's start
        c.verdict(AuditVerdict(run_id=RUN, trainer=TRAINER.peer_id, seq=r.seq, version=r.version,
                               outcome="unavailable", published=h(r.version), reason="batch missing"), 0.0)
    assert c.state == "ok"


def test_starts_of_a_trainer_that_checkpoints_faster_than_auditors_fetch_still_count() -> None:
    """A state every step, and each start's verdict comes a minute after the trainer moved 100 steps on:
    the starts are long out of the newest pinned ones, but recent, so they count."""
    c = Coverage(1)
    for seq in range(1, 301):
        c.record(rec(seq, seq, state=True), seq * 0.5)
    for seq in (2, 3):
        c.verdict(start_verdict(seq, seq), 150.0)
        assert c.state == "ok"
    c.verdict(start_verdict(4, 4), 150.0)
    assert c.state == "low" and sorted(c.unfetched) == [2, 3, 4]


def test_a_start_the_trainer_no_longer_has_to_serve_is_not_held_against_it() -> None:
    """An auditor far behind asks for starts older than the newest pinned ones, heard longer ago than
    ``SERVED_S`` (half the hour every blob is kept): an honest trainer may have let them go."""
    c = Coverage(1)
    records = [rec(seq, seq, state=True) for seq in range(1, 21)]
    for r in records[:10]:
        c.record(r, 0.0)
    for r in records[10:]:
        c.record(r, GC_MIN_AGE_S + 10)
    now = GC_MIN_AGE_S + 20
    for r in records[:10]:  # old and not among the newest pinned
        c.verdict(start_verdict(r.seq, r.version), now)
    assert c.state == "ok" and not c.unfetched
    for r in records[-PINNED_STATES:][:START_STREAK]:
        c.verdict(start_verdict(r.seq, r.version), now + GC_MIN_AGE_S)  # pinned: served however old
    assert c.state == "low"


# -- the watch: signed records and verdicts through the gossip handlers ---------------------------------

class Swarm:
    def __init__(self) -> None:
        self.peerbook = Peerbook()
        self.subscribed: dict[str, tuple[Any, Any]] = {}

    def subscribe(self, name: str, validate: Any, handler: Any, *, include_own: bool = False) -> None:
        self.subscribed[name] = (validate, handler)

    async def publish(self, name: str, data: bytes) -> None:
        pass


class Runtime:
    def __init__(self, config: Any, data_dir: Path) -> None:
        self.config = config
        self.board = StatusBoard(role="worker")
        self.swarm = Swarm()
        self.data_dir = data_dir


def started(tmp: Path, *, require: bool, every: int = EVERY) -> tuple[AuditWatch, Runtime]:
    cfg = build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                            "validator_peer_ids": [AUDITOR.peer_id], "require_audits": require,
                            "audit_checkpoint_every": every})
    rt = Runtime(cfg, tmp)
    w = AuditWatch(rt)  # type: ignore[arg-type]  # the fake runtime has what the watch uses
    asyncio.run(w.start())
    rt.board.set_state("running")
    return w, rt


def deliver(rt: Runtime, kind: str, data: bytes, origin: str) -> None:
    validate, handler = rt.swarm.subscribed[topic(RUN, kind)]
    asyncio.run(handler(validate(data, origin), origin))


def hear(rt: Runtime, r: StepRecord) -> None:
    deliver(rt, STEP_KIND, seal_record(TRAINER, r), "12D3KooWforwarder")


def test_require_audits_refuses_a_trainer_without_state_for_its_own_reason_until_back(tmp_path: Path) -> None:
    w, rt = started(tmp_path, require=True)
    gate = audit_gate(type("R", (), {"service": lambda self, kind: w})())
    for step in range(1, LIMIT + 1):
        hear(rt, rec(step, step))
        assert not gate() and rt.board.snapshot().audits.coverage == "ok"
    hear(rt, rec(LIMIT + 1, LIMIT + 1))
    snap = rt.board.snapshot()
    assert gate().startswith("audit coverage too low:") and "run.require_audits" in gate()
    assert snap.state == "degraded" and any(r.startswith("audit coverage") for r in snap.health.reasons)
    a = snap.audits
    assert (a.coverage, a.coverage_gap, a.checkpoint_every, a.refusing, a.state) == ("low", LIMIT + 1, EVERY,
                                                                                    True, "unaudited")
    assert w.status()["coverage"]["state"] == "low" and w.status()["refusing"]
    hear(rt, rec(LIMIT + 2, LIMIT + 2, state=True))  # unlike a failed audit, it lifts
    snap = rt.board.snapshot()
    assert not gate() and snap.state == "running" and not snap.audits.refusing
    assert snap.audits.coverage == "ok" and snap.audits.coverage_gap == 0


def test_without_require_audits_low_coverage_is_a_rate_limited_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w, rt = started(tmp_path, require=False)
    with caplog.at_level(logging.WARNING, logger="intellect_node.roles.common.audits"):
        for step in range(1, 3 * LIMIT):
            hear(rt, rec(step, step))
    warned = [r for r in caplog.records if "audit coverage" in r.getMessage()]
    assert len(warned) == 1 and "too low" in warned[0].getMessage()  # once, not per record
    assert not w.refusal() and rt.board.snapshot().state == "running"
    assert rt.board.snapshot().audits.coverage == "low"


def test_an_honest_trainers_records_keep_coverage_ok_on_the_watch(tmp_path: Path) -> None:
    w, rt = started(tmp_path, require=True)
    records = honest(30)
    order = [r for pair in zip(records[1::2], records[::2]) for r in pair]  # each pair swapped
    for r in order:
        hear(rt, r)
        assert not w.refusal() and rt.board.snapshot().audits.coverage == "ok", w.coverage.low


def test_a_trainer_withholding_its_start_blobs_reads_low_after_the_streak(tmp_path: Path) -> None:
    """Every start the auditors try cannot be fetched (its blobs withheld), though the records carry
    ``state`` on time: low after :data:`START_STREAK` starts, and with require_audits refused."""
    w, rt = started(tmp_path, require=True)
    records = honest(30)
    for r in records:
        hear(rt, r)
    starts = [r for r in records if r.state is not None][-START_STREAK:]
    for r in starts:
        assert not w.refusal()
        deliver(rt, AUDIT_KIND, seal_verdict(AUDITOR, start_verdict(r.seq, r.version)), AUDITOR.peer_id)
    assert "could not fetch the last 3 window starts" in w.refusal()
    a = rt.board.snapshot().audits
    assert a.coverage == "low" and a.state == "partial" and a.unavailable == START_STREAK


# -- the views and the setting --------------------------------------------------------------------------

def test_status_json_metrics_dashboard_and_cli_show_low_coverage(tmp_path: Path) -> None:
    _, rt = started(tmp_path, require=True)
    for step in range(1, LIMIT + 2):
        hear(rt, rec(step, step))
    snap = rt.board.snapshot()
    back = StatusSnapshot.from_json(snap.to_json())
    assert back.audits == snap.audits
    d = snap.to_dict()
    audits = d["audits"]
    assert isinstance(audits, dict)
    assert audits["coverage"] == "low" and audits["coverage_gap"] == LIMIT + 1

    board = StatusBoard(role="worker")
    board.set_audits(snap.audits)
    text = generate_latest(build_registry(board)).decode()
    assert 'intellect_node_audit_coverage{state="low"} 1.0' in text
    assert 'intellect_node_audit_coverage{state="ok"} 0.0' in text
    assert f"intellect_node_audit_coverage_gap_steps {float(LIMIT + 1)}" in text
    assert "intellect_node_audit_refusing 1.0" in text

    c = Console(record=True, width=80, height=24, force_terminal=True, file=io.StringIO())
    c.print(dashboard.render_node(snap, width=80, height=24, now=snap.ts))
    out = c.export_text()
    assert f"COVERAGE LOW {LIMIT + 1}/{EVERY} · refusing" in out
    assert f"AUDIT-COVERAGE-LOW=gap{LIMIT + 1}/{EVERY}:REFUSING-TRAINER" in dashboard.status_line(snap)

    cli = summary({"health": {"state": "degraded"}, "snapshot": d})
    assert "AUDIT COVERAGE LOW" in cli and f"gap {LIMIT + 1} of {EVERY} steps" in cli
    assert "NOT FOLLOWING THE TRAINER" in cli


def test_the_setting_travels_in_the_manifest_and_require_audits_holds_a_default() -> None:
    base = {"run_id": RUN, "trainer_peer_id": TRAINER.peer_id, "validator_peer_ids": [AUDITOR.peer_id]}
    with pytest.raises(ConfigError, match="run.audit_checkpoint_every"):
        build_config(run={**base, "audit_checkpoint_every": -1})
    assert build_config(run=base).run.audit_every == 0  # no rule
    required = build_config(run={**base, "require_audits": True}).run
    assert required.audit_checkpoint_every == 0 and required.audit_every == REQUIRED_AUDIT_CHECKPOINT_EVERY
    c = build_config(run={**base, "audit_checkpoint_every": 4})
    assert c.run.audit_every == 4 and run_sections(c)["run"]["audit_checkpoint_every"] == 4
