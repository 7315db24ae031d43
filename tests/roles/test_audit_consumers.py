"""What the other nodes of a run do with the auditors' verdicts (``roles/common/audits.py``).

Real processes on loopback (trainer, an auditing validator, one worker, the embedded model), with
``run.require_audits`` on:

- a trainer that adds an update of its own after each step (``tests/support/dishonest_trainer.py``,
  ``nudge``) fails its first trained step; the worker and the validator show the failed audit in their
  status (state ``failed``, the step, the hash the replay made and the one published, ``degraded`` with
  the reason), keep the signed verdict as evidence in their data dirs, and stop following it: the
  worker's policy version and its batches stop while the trainer's announcements keep coming (each one
  refused), and a restarted worker still refuses it, from its evidence, before submitting anything;
- an honest trainer's steps pass on every node and the run keeps going.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from intellect_node.commands.status import summary
from intellect_node.protocol.audits import open_verdict
from tests.support.roles import ENV, listen_addr, role_run, write_config
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RL = dict(group_size=8, problems_per_batch=2, groups_per_step=2, max_new_tokens=5, batches_per_version=2,
          checkpoint_every=1000, ban_after=1000, lr=1e-3)
RUN_ID = "e2e"


def _audits(proc: NodeProcess) -> dict[str, Any]:
    a = proc.status()["snapshot"]["audits"]
    assert isinstance(a, dict), a
    return a


def _role(proc: NodeProcess, role: str) -> dict[str, Any]:
    st = proc.status()[role]
    assert isinstance(st, dict), st
    return st


def _check_evidence(data_dir: Path, trainer: str, auditor: str) -> int:
    """The evidence a node kept: the signed verdict opens as a fail by the auditor about the trainer, and
    its JSON says the same; the failed step's seq."""
    found = sorted((data_dir / "audits" / RUN_ID / "evidence").glob("*.json"))
    assert found, f"no evidence in {data_dir}"
    import json

    doc = json.loads(found[0].read_text())
    raw = (found[0].parent / doc["envelope"]).read_bytes()
    v, signer = open_verdict(raw, run_id=RUN_ID, auditors=frozenset({auditor}))
    assert signer == auditor == doc["auditor"] and v.trainer == trainer == doc["trainer"]
    assert v.outcome == "fail" and v.seq == doc["seq"] and v.expected == doc["expected"]
    assert v.expected and v.expected != v.published == doc["published"]
    return v.seq


def _refusing(proc: NodeProcess, role: str) -> bool:
    a = _audits(proc)
    return bool(a["state"] == "failed" and a["refusing"] and _role(proc, role)["audit_refusal"])


def test_a_trainer_that_failed_an_audit_is_not_followed(tmp_path: Path) -> None:
    with role_run(tmp_path, ("trainer", "validator", "w1"), rl=RL, validator={"audit": True},
                  require_audits=True) as run:
        write_config(tmp_path / "trainer", **run.common)
        trainer = NodeProcess(tmp_path / "trainer", env=ENV,
                              argv=[sys.executable, "-m", "tests.support.dishonest_trainer", "nudge",
                                    str(tmp_path / "trainer")])
        _, t_addr, validator, v_addr = run.trainer_and_validator(trainer)
        worker = run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        listen_addr(worker)
        wait_for(lambda: _refusing(worker, "worker") and _refusing(validator, "validator"), timeout=600,
                 what="the worker and the validator refusing the trainer after its failed audit")

        ids = run.ids
        for proc, name in ((worker, "w1"), (validator, "validator")):
            st = proc.status()
            a = st["snapshot"]["audits"]
            f = a["first_failed"]
            assert a["trainer"] == ids["trainer"] and a["required"] and a["failed"] >= 1, a
            assert f["auditor"] == ids["validator"] and f["expected"] and f["expected"] != f["published"]
            assert "replayed weights differ" in f["reason"]
            assert st["health"]["state"] == "degraded"
            assert any("failed the audit" in r for r in st["health"]["reasons"]), st["health"]
            assert st["audits"]["refusing"] and st["audits"]["evidence"]
            text = summary(st)  # what `intellect-node status` prints
            assert f"AUDIT FAILED step {f['seq']}" in text and "NOT FOLLOWING THE TRAINER" in text
            assert f["expected"] in text and f["published"] in text
            assert _check_evidence(tmp_path / name, ids["trainer"], ids["validator"]) == f["seq"]

        # It stops following: while the trainer keeps announcing (each announcement refused), the
        # worker's policy and batches stay where they were, and the validator adopts no newer policy.
        w, v = _role(worker, "worker"), _role(validator, "validator")
        wait_for(lambda: (_role(worker, "worker")["refused_announcements"] >= w["refused_announcements"] + 3
                          and _role(validator, "validator")["refused_announcements"]
                          >= v["refused_announcements"] + 3),
                 timeout=120, what="three more announcements refused by each")
        w2, v2 = _role(worker, "worker"), _role(validator, "validator")
        assert (w2["policy_version"], w2["batches"]) == (w["policy_version"], w["batches"]), (w, w2)
        assert max(v2["versions_held"]) == max(v["versions_held"]), (v, v2)

        # A restarted worker refuses the trainer from its evidence, before it submits anything.
        worker.stop()
        worker = run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        listen_addr(worker)
        assert _refusing(worker, "worker"), _audits(worker)
        wait_for(lambda: _role(worker, "worker")["refused_announcements"] >= 3, timeout=120,
                 what="the restarted worker refusing three announcements")
        st = _role(worker, "worker")
        assert st["batches"] == 0 and st["withheld"] == 0, st


def test_an_honest_trainer_passes_on_every_node_and_the_run_goes_on(tmp_path: Path) -> None:
    with role_run(tmp_path, ("trainer", "validator", "w1"), rl=RL, validator={"audit": True},
                  require_audits=True) as run:
        trainer, t_addr, validator, v_addr = run.trainer_and_validator()
        worker = run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        listen_addr(worker)
        wait_for(lambda: all(_audits(p)["passed"] >= 2 for p in (worker, validator, trainer)), timeout=600,
                 what="two steps passed, as seen by the worker, the validator and the trainer")
        for proc in (worker, validator, trainer):
            a = _audits(proc)
            assert a["state"] == "passing" and a["failed"] == 0 and a["unavailable"] == 0, a
            assert not a["refusing"] and a["first_failed"] is None and a["heard_from"] == 1, a
            assert a["last_verdict_age_s"] is not None
            assert proc.status()["health"]["state"] == "running"
        # the run goes on: the worker keeps submitting and following newer policies
        before = _role(worker, "worker")
        wait_for(lambda: _role(worker, "worker")["policy_version"] > before["policy_version"]
                 and _role(worker, "worker")["batches"] > before["batches"], timeout=300,
                 what="the worker on a newer policy, with more batches submitted")
        assert not _role(worker, "worker")["audit_refusal"]
