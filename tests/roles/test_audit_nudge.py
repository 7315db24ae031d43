"""A trainer that turns dishonest mid-run: both auditors catch it, and the run stops following it.

One run of real processes on loopback (the embedded model), with ``run.require_audits`` on and
``rl.checkpoint_every`` 2:

- the trainer: ``tests/support/dishonest_trainer.py`` ``nudge``, honest until the test gives the cue,
  then adding an update of its own to the weights after each step it trains;
- its validator with ``validator.audit`` on: the first auditor, replaying every step from version 0;
- a worker;
- once the trainer has published a checkpoint's state, a second auditor (a validator named in
  ``run.auditor_peer_ids``, ``audit_fraction`` 1.0) that never heard the steps from version 0: its
  windows start at a later checkpoint, from the weights and optimizer state it fetches through the swarm.
  The cue is given once its first window is under way.

Asserted:

1. each auditor fails the first nudged step (the first version the trainer nudged), in the window that
   holds it (the one from the last checkpoint before it; for the second auditor, a window from a
   checkpoint), with the hash the replay made and the one published, after passing every step before;
2. the worker and the validator show the failed audit in their status (state ``failed``, the step, the two
   hashes, ``degraded`` with the reason; the text ``intellect-node status`` prints says so), keep the
   signed verdict as evidence in their data dirs, and stop following the trainer: the worker's policy
   version and batches and the validator's policies stay where they were while the trainer's
   announcements keep coming (each refused); the trainer and the second auditor show the failure too;
3. a restarted worker refuses the trainer from its evidence, before it submits anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from intellect_node.commands.status import summary
from intellect_node.protocol.audits import open_verdict
from tests.support.audit_run import (
    RL,
    audit_of,
    audits_seen,
    role_status,
    shows_failed,
    start_swarm,
    verdicts,
)
from tests.support.dishonest_trainer import CUE
from tests.support.roles import listen_addr, role_run
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_ID = "e2e"


def _check_evidence(data_dir: Path, trainer: str, auditors: frozenset[str]) -> int:
    """The evidence a node kept: the signed verdict opens as a fail by one of the run's auditors about the
    trainer, and its JSON says the same; the failed step's seq."""
    found = sorted((data_dir / "audits" / RUN_ID / "evidence").glob("*.json"))
    assert found, f"no evidence in {data_dir}"
    doc = json.loads(found[0].read_text())
    raw = (found[0].parent / doc["envelope"]).read_bytes()
    v, signer = open_verdict(raw, run_id=RUN_ID, auditors=auditors)
    assert signer == doc["auditor"] and v.trainer == trainer == doc["trainer"]
    assert v.outcome == "fail" and v.seq == doc["seq"] and v.expected == doc["expected"]
    assert v.expected and v.expected != v.published == doc["published"]
    return v.seq


def _refusing(proc: NodeProcess, role: str) -> bool:
    a = audits_seen(proc)
    return bool(a["state"] == "failed" and a["refusing"] and role_status(proc, role)["audit_refusal"])


def _window_started(proc: NodeProcess) -> bool:
    """The auditor replays a window from a checkpoint (its start fetched and loaded)."""
    st = audit_of(proc)
    return st["state"] == "following" and int(st["window"].get("start_version", 0)) >= 1


def test_nudging_trainer_is_caught_by_both_auditors_and_not_followed(tmp_path: Path) -> None:
    names = ("trainer", "validator", "auditor", "w1")
    with role_run(tmp_path, names, rl={**RL, "checkpoint_every": 2}, validator={"audit": True},
                  auditors=("auditor",), require_audits=True) as run:
        sw = start_swarm(run, "nudge")
        trainer, validator, worker = sw.trainer, sw.validator, sw.workers["w1"]
        t_addr, v_addr = sw.t_addr, sw.v_addr
        wait_for(lambda: bool(role_status(trainer, "trainer")["records"].get("states")), timeout=600,
                 what="a checkpoint state published")
        auditor = run.start("auditor", "validator", bootstrap=[t_addr, v_addr],
                            validator={"audit": True, "audit_fraction": 1.0})
        listen_addr(auditor)
        wait_for(lambda: _window_started(auditor), timeout=600, what="the second auditor in a window")
        (tmp_path / "trainer" / CUE).touch()
        wait_for(lambda: _refusing(worker, "worker") and _refusing(validator, "validator")
                 and audit_of(validator)["fail"] and audit_of(auditor)["fail"], timeout=600,
                 what="both auditors failing a step, the worker and the validator refusing the trainer")

        # 1. each auditor fails the first nudged step, in the window that holds it
        nudged = role_status(trainer, "trainer")["nudged"][0]
        states = [int(v) for v in role_status(trainer, "trainer")["records"]["states"]]
        holding = max((s for s in states if s < nudged), default=0)  # the window's start
        seqs = set()
        for proc, name in ((validator, "validator"), (auditor, "auditor")):
            st = audit_of(proc)
            bad = st["first_bad"]
            assert bad["outcome"] == "fail" and int(bad["version"]) == nudged, (name, st)
            assert bad["expected"] and bad["expected"] != bad["published"], bad
            assert "replayed weights differ" in str(bad["reason"]), bad
            assert int(bad["window"]) == holding, (name, bad, states)
            mine = verdicts(tmp_path / name)
            k = [v["outcome"] for v in mine].index("fail")
            assert all(v["outcome"] == "pass" for v in mine[:k]) and mine[k]["seq"] == bad["seq"], mine
            seqs.add(int(bad["seq"]))
        first_window = int(verdicts(tmp_path / "auditor")[0]["window"])
        assert 2 <= first_window <= holding, (first_window, holding)
        assert len(seqs) == 1, seqs
        (seq,) = seqs

        # 2. every node shows it; the worker and the validator keep the evidence and stop following
        ids = run.ids
        auditors = frozenset({ids["validator"], ids["auditor"]})
        for proc, name in ((worker, "w1"), (validator, "validator")):
            st = proc.status()
            a = st["snapshot"]["audits"]
            f = a["first_failed"]
            assert a["trainer"] == ids["trainer"] and a["required"] and a["failed"] >= 1, a
            assert f["seq"] == seq and f["auditor"] in auditors, f
            assert f["expected"] and f["expected"] != f["published"], f
            assert "replayed weights differ" in f["reason"]
            assert st["health"]["state"] == "degraded"
            assert any("failed the audit" in r for r in st["health"]["reasons"]), st["health"]
            assert st["audits"]["refusing"] and st["audits"]["evidence"]
            text = summary(st)  # what `intellect-node status` prints
            assert f"AUDIT FAILED step {f['seq']}" in text and "NOT FOLLOWING THE TRAINER" in text
            assert f["expected"] in text and f["published"] in text
            assert _check_evidence(tmp_path / name, ids["trainer"], auditors) == seq
        wait_for(lambda: shows_failed(trainer, seq) and shows_failed(auditor, seq), timeout=120,
                 what="the trainer and the second auditor showing the failed step")

        # It stops following: while the trainer keeps announcing (each announcement refused), the
        # worker's policy and batches stay where they were, and the validator adopts no newer policy.
        w, v = role_status(worker, "worker"), role_status(validator, "validator")

        def refused_more() -> bool:
            now_w, now_v = role_status(worker, "worker"), role_status(validator, "validator")
            return bool(now_w["refused_announcements"] >= w["refused_announcements"] + 3
                        and now_v["refused_announcements"] >= v["refused_announcements"] + 3)

        wait_for(refused_more, timeout=120, what="three more announcements refused by each")
        w2, v2 = role_status(worker, "worker"), role_status(validator, "validator")
        assert (w2["policy_version"], w2["batches"]) == (w["policy_version"], w["batches"]), (w, w2)
        assert max(v2["versions_held"]) == max(v["versions_held"]), (v, v2)

        # 3. A restarted worker refuses the trainer from its evidence, before it submits anything.
        worker.stop()
        worker = run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        listen_addr(worker)
        assert _refusing(worker, "worker"), audits_seen(worker)
        wait_for(lambda: role_status(worker, "worker")["refused_announcements"] >= 3, timeout=120,
                 what="the restarted worker refusing three announcements")
        st = role_status(worker, "worker")
        assert st["batches"] == 0 and st["withheld"] == 0, st
