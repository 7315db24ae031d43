"""The audit watch every node of a run runs (``roles/common/audits.py``), in this process: the tally's
aggregation and bounds, the gossip validator's decoding (honest auditor, mallory, garbage), the
evidence kept and read back after a restart, and the state as status, ``/metrics``, the dashboard and
``intellect-node status`` show it. The real-process test is ``test_audit_nudge.py``."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from rich.console import Console

from intellect_node import dashboard
from intellect_node.commands.status import summary
from intellect_node.config import NodeConfig, build_config
from intellect_node.config.run_manifest import run_sections
from intellect_node.config.status import StatusBoard, StatusSnapshot
from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.node.metrics import build_registry
from intellect_node.protocol import codec
from intellect_node.protocol.audits import AUDIT_KIND, AuditVerdict, seal_verdict
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import Envelope, SigningKey
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.audits import AuditTally, AuditWatch, audit_gate
from tests.support.peerbook import Peerbook

RUN = "aud"
TRAINER = SigningKey.generate()
AUDITOR = SigningKey.generate()
OTHER_AUDITOR = SigningKey.generate()
MALLORY = SigningKey.generate()
H1, H2 = cid_of(b"published"), cid_of(b"replayed")


def verdict(seq: int, outcome: str = "pass", *, trainer: str | None = None, run_id: str = RUN
            ) -> AuditVerdict:
    expected = {"pass": H1, "fail": H2, "unavailable": ""}[outcome]
    return AuditVerdict(run_id=run_id, trainer=trainer or TRAINER.peer_id, seq=seq, version=seq,
                        outcome=outcome, published=H1, expected=expected,  # type: ignore[arg-type]  # a str, one of the literals
                        reason="replayed weights differ" if outcome == "fail" else "")


class Swarm:
    """What the watch uses of a swarm: subscribe (kept here) and the peerbook's blame."""

    def __init__(self) -> None:
        self.peerbook = Peerbook()
        self.subscribed: dict[str, Any] = {}

    def subscribe(self, name: str, validate: Any, handler: Any, *, include_own: bool = False) -> None:
        assert include_own, "an auditing validator's own verdicts count too"
        self.subscribed[name] = (validate, handler)


class Runtime:
    def __init__(self, config: NodeConfig, data_dir: Path) -> None:
        self.config = config
        self.board = StatusBoard(role="worker")
        self.swarm = Swarm()
        self.data_dir = data_dir


def cfg(*, require: bool = True, auditors: tuple[str, ...] = (AUDITOR.peer_id,)) -> NodeConfig:
    return build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                             "validator_peer_ids": list(auditors), "require_audits": require})


def watch(tmp: Path, **kw: Any) -> tuple[AuditWatch, Runtime]:
    rt = Runtime(cfg(**kw), tmp)
    w = AuditWatch(rt)  # type: ignore[arg-type]  # the fake runtime has what the watch uses
    asyncio.run(w.start())
    return w, rt


def deliver(w: AuditWatch, rt: Runtime, data: bytes, origin: str | None = None) -> None:
    """Through the gossip validator then the handler, as the swarm would; published by ``origin``, by
    default the verdict's signer (who alone may publish it)."""
    validate, handler = rt.swarm.subscribed[topic(RUN, AUDIT_KIND)]
    if origin is None:
        origin = codec.decode(data, Envelope, max_size=len(data)).signer
    asyncio.run(handler(validate(data, origin), origin))


# -- the tally --------------------------------------------------------------------------------------

def test_steps_count_once_failure_wins_and_unavailable_is_never_a_pass() -> None:
    t = AuditTally(TRAINER.peer_id)
    assert t.state == "unaudited"
    assert t.add(verdict(1), AUDITOR.peer_id) and t.add(verdict(1), OTHER_AUDITOR.peer_id) is False
    assert (t.audited, t.counts["passed"], t.state) == (1, 1, "passing")
    assert t.add(verdict(1), AUDITOR.peer_id) is False  # a repeat (gossip replays) changes nothing
    assert t.add(verdict(2, "unavailable"), AUDITOR.peer_id)
    assert (t.counts["unavailable"], t.state) == (1, "partial")  # not passing: step 2 was not audited
    assert t.add(verdict(2), OTHER_AUDITOR.peer_id)  # another auditor could: the step passed
    assert (t.audited, t.counts, t.state) == (2, {"passed": 2, "failed": 0, "unavailable": 0}, "passing")
    assert t.add(verdict(3, "fail"), OTHER_AUDITOR.peer_id)
    assert t.add(verdict(3), AUDITOR.peer_id) is False  # a pass does not undo another auditor's failure
    assert (t.audited, t.counts["failed"], t.state) == (3, 1, "failed")
    assert t.heard_from == 2


def test_an_auditor_may_not_contradict_itself_nor_speak_of_another_trainer() -> None:
    t = AuditTally(TRAINER.peer_id)
    t.add(verdict(1, "unavailable"), AUDITOR.peer_id)
    assert t.add(verdict(1, "pass"), AUDITOR.peer_id)  # unavailable may become an outcome later
    with pytest.raises(ProtocolError, match="contradicts the pass"):
        t.add(verdict(1, "fail"), AUDITOR.peer_id)
    with pytest.raises(ProtocolError, match="trainer"):
        t.add(verdict(2, trainer=MALLORY.peer_id), AUDITOR.peer_id)
    assert t.counts == {"passed": 1, "failed": 0, "unavailable": 0}


def test_memory_is_bounded_and_old_steps_stay_counted() -> None:
    t = AuditTally(TRAINER.peer_id, max_steps=100, max_per_auditor=10)
    for seq in range(1, 1001):
        t.add(verdict(seq), AUDITOR.peer_id)
    assert len(t._steps) == 100 and len(t._by_auditor[AUDITOR.peer_id]) == 10
    assert t.counts["passed"] == 1000 and t.audited == 1000
    assert t.add(verdict(5, "fail"), OTHER_AUDITOR.peer_id) is False  # a step let go: ignored
    assert t.state == "passing"


def test_the_first_failed_step_is_the_lowest() -> None:
    from intellect_node.roles.common.audits import Evidence

    t = AuditTally(TRAINER.peer_id)
    for seq in (7, 3, 9):
        v = verdict(seq, "fail")
        t.add(v, AUDITOR.peer_id)
        t.failed(Evidence(v, AUDITOR.peer_id, b"", 0.0))
    assert t.first_failed is not None and t.first_failed.verdict.seq == 3


# -- decoding at the gossip validator ---------------------------------------------------------------

def test_only_the_runs_auditors_about_its_trainer_are_accepted(tmp_path: Path) -> None:
    w, rt = watch(tmp_path)
    validate, _ = rt.swarm.subscribed[topic(RUN, AUDIT_KIND)]
    v, signer, data = validate(seal_verdict(AUDITOR, verdict(1)), AUDITOR.peer_id)  # the honest auditor
    assert signer == AUDITOR.peer_id and v.seq == 1 and data
    with pytest.raises(ProtocolError, match="another peer than its publisher"):  # its verdict, by another
        validate(seal_verdict(AUDITOR, verdict(2)), MALLORY.peer_id)
    with pytest.raises(ProtocolError, match="not one of the run's auditors"):  # published by its signer
        validate(seal_verdict(MALLORY, verdict(1, "fail")), MALLORY.peer_id)
    for bad, why in ((seal_verdict(AUDITOR, verdict(1, run_id="other")), "for run"),
                     (seal_verdict(AUDITOR, verdict(1, trainer=MALLORY.peer_id)), "about trainer"),
                     (b"\x00" * 10, "."), (b"x" * 100_000, ".")):
        with pytest.raises(ProtocolError, match=why):
            validate(bad, AUDITOR.peer_id)
    assert w.tally.audited == 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    w = AuditWatch(Runtime(cfg(), Path("/nonexistent")))  # type: ignore[arg-type]  # a stand-in for it
    with pytest.raises(ProtocolError):
        w._validate(data, "x")


# -- the watch: state, refusal, evidence ------------------------------------------------------------

def test_a_failed_audit_is_kept_as_evidence_refused_and_still_refused_after_a_restart(tmp_path: Path) -> None:
    w, rt = watch(tmp_path)
    rt.board.set_state("running")
    gate = audit_gate(type("R", (), {"service": lambda self, kind: w})())
    assert rt.board.snapshot().audits.state == "unaudited" and not gate()
    deliver(w, rt, seal_verdict(AUDITOR, verdict(1)))
    a = rt.board.snapshot().audits
    assert (a.state, a.passed, a.audited, a.heard_from, a.refusing) == ("passing", 1, 1, 1, False)
    assert a.last_verdict_at > 0 and not gate()
    envelope = seal_verdict(AUDITOR, verdict(2, "fail"))
    deliver(w, rt, envelope)
    snap = rt.board.snapshot()
    a = snap.audits
    assert a.state == "failed" and a.refusing and a.first_failed is not None
    assert (a.first_failed.seq, a.first_failed.expected, a.first_failed.published) == (2, H2, H1)
    assert "failed the audit of step 2" in gate() and snap.state == "degraded"
    assert any("not following it" in r for r in snap.health.reasons)
    folder = tmp_path / "audits" / RUN / "evidence"
    doc = json.loads((folder / "2.json").read_text())
    assert (folder / "2.verdict").read_bytes() == envelope
    assert doc == {"run_id": RUN, "trainer": TRAINER.peer_id, "auditor": AUDITOR.peer_id, "seq": 2,
                   "version": 2, "outcome": "fail", "expected": H2, "published": H1,
                   "reason": "replayed weights differ", "received_at": doc["received_at"],
                   "envelope": "2.verdict"}

    w2, rt2 = watch(tmp_path)  # a restart: the evidence read back, the trainer refused at once
    a = rt2.board.snapshot().audits
    assert a.refusing and a.first_failed is not None and a.first_failed.seq == 2 and w2.refusal()
    assert w2.status()["evidence"] == {"2": str(folder / "2.json")}


def test_evidence_that_does_not_verify_is_left_out(tmp_path: Path) -> None:
    w, rt = watch(tmp_path)
    deliver(w, rt, seal_verdict(AUDITOR, verdict(4, "fail")))
    raw = tmp_path / "audits" / RUN / "evidence" / "4.verdict"
    data = bytearray(raw.read_bytes())
    data[-5] ^= 1  # a flipped bit: the signature no longer holds
    raw.write_bytes(bytes(data))
    w2, rt2 = watch(tmp_path)
    assert not w2.refusal() and rt2.board.snapshot().audits.state == "unaudited"
    # nor evidence signed by an auditor the run no longer names
    w3, rt3 = watch(tmp_path / "b", auditors=(OTHER_AUDITOR.peer_id, AUDITOR.peer_id))
    deliver(w3, rt3, seal_verdict(OTHER_AUDITOR, verdict(1, "fail")))
    w4, _ = watch(tmp_path / "b")
    assert not w4.refusal()


def test_without_require_audits_a_failure_is_shown_and_nothing_stops(tmp_path: Path) -> None:
    w, rt = watch(tmp_path, require=False)
    deliver(w, rt, seal_verdict(AUDITOR, verdict(1, "fail")))
    snap = rt.board.snapshot()
    assert snap.audits.state == "failed" and not snap.audits.refusing and not w.refusal()
    assert snap.state != "degraded" and (tmp_path / "audits" / RUN / "evidence" / "1.json").exists()


def test_a_contradicting_auditor_is_blamed_and_its_word_not_taken(tmp_path: Path) -> None:
    w, rt = watch(tmp_path)
    deliver(w, rt, seal_verdict(AUDITOR, verdict(1)))
    deliver(w, rt, seal_verdict(AUDITOR, verdict(1, "fail")))
    assert not w.refusal() and w.tally.counts["failed"] == 0
    assert rt.swarm.peerbook.rejections and rt.swarm.peerbook.rejections[0][0] == AUDITOR.peer_id
    assert "contradicts" in rt.swarm.peerbook.rejections[0][1]


def test_a_run_without_auditors_reads_unaudited_and_subscribes_to_nothing(tmp_path: Path) -> None:
    w, rt = watch(tmp_path, require=False, auditors=())
    a = rt.board.snapshot().audits
    assert a.state == "unaudited" and "names no auditor" in a.detail and not rt.swarm.subscribed


# -- the views --------------------------------------------------------------------------------------

def _failed_snapshot(tmp: Path) -> StatusSnapshot:
    w, rt = watch(tmp)
    deliver(w, rt, seal_verdict(AUDITOR, verdict(1)))
    deliver(w, rt, seal_verdict(AUDITOR, verdict(2, "fail")))
    rt.board.set_state("running")
    return rt.board.snapshot()


def test_status_json_metrics_dashboard_and_cli_show_the_failure(tmp_path: Path) -> None:
    snap = _failed_snapshot(tmp_path)
    back = StatusSnapshot.from_json(snap.to_json())
    assert back.audits == snap.audits
    d: dict[str, Any] = snap.to_dict()
    assert d["audits"]["state"] == "failed" and isinstance(d["audits"]["last_verdict_age_s"], float)

    board = StatusBoard(role="worker")
    board.set_audits(snap.audits)
    text = generate_latest(build_registry(board)).decode()
    assert 'intellect_node_audit_state{state="failed"} 1.0' in text
    assert 'intellect_node_audit_state{state="passing"} 0.0' in text
    assert 'intellect_node_audit_steps{outcome="passed"} 1.0' in text
    assert 'intellect_node_audit_steps{outcome="failed"} 1.0' in text
    assert "intellect_node_audit_refusing 1.0" in text and "intellect_node_audit_first_failed_seq 2.0" in text
    assert "intellect_node_audit_last_verdict_age_seconds" in text

    c = Console(record=True, width=80, height=24, force_terminal=True, file=io.StringIO())
    c.print(dashboard.render_node(snap, width=80, height=24, now=snap.ts))
    lines = c.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 80
    assert any(line.startswith("AUDIT FAILED step 2 (v2) · NOT FOLLOWING THE TRAINER") for line in lines)
    assert any("FAILED step 2" in line and "refusing" in line for line in lines)  # the swarm panel's row
    line = dashboard.status_line(snap)
    assert "audit=failed:1/2" in line and "AUDIT-FAILED=step2:REFUSING-TRAINER" in line

    out = summary({"health": {"state": "degraded"}, "snapshot": d})
    assert "AUDIT FAILED step 2 (v2)" in out and "NOT FOLLOWING THE TRAINER" in out
    assert H1 in out and H2 in out


def test_no_verdict_is_unaudited_not_healthy_looking() -> None:
    snap = StatusBoard(role="worker").snapshot()
    d: dict[str, Any] = snap.to_dict()
    assert snap.audits.state == "unaudited" and d["audits"]["last_verdict_age_s"] is None
    assert "UNAUDITED" in summary({"health": {}, "snapshot": snap.to_dict()})
    text = generate_latest(build_registry(StatusBoard())).decode()
    assert 'intellect_node_audit_state{state="unaudited"} 1.0' in text
    assert "intellect_node_audit_last_verdict_age_seconds" not in text  # absent: never audited


# -- configuration ----------------------------------------------------------------------------------

def test_require_audits_needs_an_auditor_and_travels_in_the_run_manifest() -> None:
    with pytest.raises(ConfigError, match="require_audits"):
        build_config(run={"run_id": RUN, "require_audits": True})
    with pytest.raises(ConfigError, match="auditor_peer_ids"):
        build_config(run={"auditor_peer_ids": ["not-a-peer"]})
    c = build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id, "require_audits": True,
                          "auditor_peer_ids": [AUDITOR.peer_id]})
    shared = run_sections(c)["run"]
    assert shared["require_audits"] is True and shared["auditor_peer_ids"] == [AUDITOR.peer_id]


def test_evidence_that_cannot_be_written_does_not_hide_the_failure(tmp_path: Path) -> None:
    w, rt = watch(tmp_path)
    (tmp_path / "audits" / RUN).mkdir(parents=True)
    (tmp_path / "audits" / RUN / "evidence").write_text("a file where the folder goes")
    deliver(w, rt, seal_verdict(AUDITOR, verdict(3, "fail")))
    assert w.refusal() and rt.board.snapshot().audits.state == "failed" and not w.evidence


# -- run.audit_quorum ---------------------------------------------------------------------------------

def _quorum_watch(tmp: Path, quorum: int) -> tuple[AuditWatch, Runtime]:
    rt = Runtime(build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                                   "validator_peer_ids": [AUDITOR.peer_id, OTHER_AUDITOR.peer_id],
                                   "require_audits": True, "audit_quorum": quorum}), tmp)
    w = AuditWatch(rt)  # type: ignore[arg-type]  # a stand-in for it
    asyncio.run(w.start())
    return w, rt


def test_one_auditor_below_the_quorum_halts_nothing_and_a_quorum_does(tmp_path: Path) -> None:
    w, rt = _quorum_watch(tmp_path, 2)
    deliver(w, rt, seal_verdict(AUDITOR, verdict(3, "fail")))
    deliver(w, rt, seal_verdict(AUDITOR, verdict(3, "fail")))  # a repeat is not a second auditor
    assert w.refusal() == "" and w.status()["failed_by"] == {"3": 1} and w.status()["state"] == "failed"
    deliver(w, rt, seal_verdict(OTHER_AUDITOR, verdict(5, "fail")))  # another step: no quorum either
    assert w.refusal() == ""
    deliver(w, rt, seal_verdict(OTHER_AUDITOR, verdict(3, "fail")))
    assert "step 3" in w.refusal() and "2 auditors" in w.refusal()
    again, _ = _quorum_watch(tmp_path, 2)  # both failures kept and checked again: still refusing
    assert "step 3" in again.refusal()


def test_the_default_quorum_of_one_keeps_one_failure_enough(tmp_path: Path) -> None:
    w, rt = _quorum_watch(tmp_path, 1)
    deliver(w, rt, seal_verdict(OTHER_AUDITOR, verdict(4, "fail")))
    assert "step 4 (v4) by " + OTHER_AUDITOR.peer_id in w.refusal()


def test_a_quorum_larger_than_the_auditors_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="audit_quorum 3 exceeds the 2 auditors"):
        build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                          "validator_peer_ids": [AUDITOR.peer_id, OTHER_AUDITOR.peer_id], "audit_quorum": 3})
