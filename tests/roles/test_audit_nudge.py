"""A trainer honest at first, then dishonest: no node flags it while honest, both auditors catch it after.

One run of real processes on loopback (the embedded model) for the whole module, with
``run.require_audits`` on, ``run.async_level`` 1 (a batch's deadline comes two versions after it) and
``rl.checkpoint_every`` 2:

- the trainer: ``tests/support/dishonest_trainer.py`` ``nudge``, honest until the test gives the cue,
  then adding an update of its own to the weights after each step it trains;
- its validator with ``validator.audit`` on: the first auditor, replaying every step from version 0;
- an honest worker ``w1`` and a worker ``c1`` whose batches the validator rejects (it claims reward 1.0
  for every rollout);
- once the trainer has published a checkpoint's state, a second auditor (a validator named in
  ``run.auditor_peer_ids``, ``audit_fraction`` 1.0) that never heard the steps from version 0: its
  windows start at a later checkpoint, from the weights and optimizer state it fetches through the swarm.

While the trainer is honest (before the cue), once the first auditor passed steps up to version 3 (every
batch of version 0 past its deadline) and the second a whole window, the module's fixture takes every
node's status, and ``test_an_honest_trainer_is_never_flagged`` asserts on it:

1. the first auditor: every step passes, its replayed hash the published one, admission evidence included
   (each batch taken carries its acceptance, every accepted batch is named by a record), and at each
   checkpoint the replayed optimizer state is the published one; it is still following;
2. the second: its first window starts at a checkpoint (v2 or later) and reaches the next one, where the
   replayed optimizer state is the published one; every verdict passes;
3. the trainer's records (the receipts every node keeps): ``w1``'s batches trained, none of ``c1``'s, and
   the trainer refused at least one of ``c1``'s on its validator's rejection;
4. every node (trainer, both auditors, both workers) shows the audits ``passing``, heard from both
   auditors, nothing failed or unavailable, nothing refused; the honest nodes read ``running``;
5. the run went on meanwhile: the worker followed newer policies and submitted more batches.

Then ``test_a_nudging_trainer_is_caught_by_both_auditors_and_not_followed`` gives the cue, and asserts:

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from intellect_node.commands.status import summary
from intellect_node.protocol.audits import open_verdict
from tests.support.audit_run import (
    RL,
    Swarm,
    audit_of,
    audits_seen,
    records,
    role_status,
    shows_failed,
    start_swarm,
    verdicts,
)
from tests.support.dishonest_trainer import CUE
from tests.support.roles import RoleRun, listen_addr, role_run
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_ID = "e2e"
NODES = ("trainer", "validator", "auditor", "w1", "c1")


def _passed_version(data_dir: Path) -> int:
    """The newest version an auditor passed (-1: none)."""
    return max((int(v["version"]) for v in verdicts(data_dir) if v["outcome"] == "pass"), default=-1)


def _states(trainer: NodeProcess) -> list[int]:
    """The versions whose checkpoint state the trainer published."""
    return list(role_status(trainer, "trainer")["records"].get("states") or [])


@dataclass
class Audited:
    """The module's run: its nodes (``procs`` by name, the second auditor among them), and what was seen
    while the trainer was honest: each node's status (``honest``), each auditor's verdicts and the
    trainer's records then, and the worker's status before the second auditor started and after."""

    root: Path
    run: RoleRun
    sw: Swarm
    procs: dict[str, NodeProcess]
    honest: dict[str, dict[str, Any]]
    verdicts: dict[str, list[dict[str, Any]]]
    records: dict[int, dict[str, Any]]
    before: dict[str, Any]
    after: dict[str, Any]


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Audited]:
    tmp = tmp_path_factory.mktemp("audits")
    with role_run(tmp, NODES, rl={**RL, "checkpoint_every": 2}, async_level=1, require_audits=True,
                  validator={"audit": True}, auditors=("auditor",)) as run:
        sw = start_swarm(run, "nudge", cheats=("c1",))
        trainer, validator, worker = sw.trainer, sw.validator, sw.workers["w1"]
        wait_for(lambda: bool(_states(trainer)), timeout=600, what="a checkpoint state published")
        before = role_status(worker, "worker")
        auditor = run.start("auditor", "validator", bootstrap=[sw.t_addr, sw.v_addr],
                            validator={"audit": True, "audit_fraction": 1.0})
        listen_addr(auditor)
        procs = {"trainer": trainer, "validator": validator, "auditor": auditor, "w1": worker,
                 "c1": sw.workers["c1"]}
        wait_for(lambda: (_passed_version(tmp / "validator") >= 3
                          and role_status(trainer, "trainer")["rejected_batches"] >= 1
                          and audit_of(auditor)["windows"]["pass"] >= 1
                          and all(audits_seen(p)["heard_from"] == 2 for p in procs.values())),
                 timeout=600, what="steps up to v3 audited from v0, a window from a checkpoint passed, a "
                                   "cheat's batch refused and both auditors heard everywhere")
        after = role_status(worker, "worker")
        honest = {name: proc.status() for name, proc in procs.items()}
        seen = {name: verdicts(tmp / name) for name in ("validator", "auditor")}
        assert not role_status(trainer, "trainer")["nudged"], "the trainer nudged before the cue"
        yield Audited(tmp, run, sw, procs, honest, seen, records(tmp / "trainer"), before, after)


def test_an_honest_trainer_is_never_flagged(audited: Audited) -> None:
    honest, ids = audited.honest, audited.run.ids

    # 1. the first auditor, from version 0
    st = honest["validator"]["validator"]["audit"]
    assert st["fail"] == 0 and st["unavailable"] == 0 and st["state"] == "following", st
    first = audited.verdicts["validator"]
    assert first and all(v["outcome"] == "pass" and v["expected"] == v["published"] for v in first)
    assert int(first[0]["window"]) == 0 and st["windows"]["fail"] == 0, (first[0], st)

    # 2. the second auditor, from a checkpoint to the next
    st = honest["auditor"]["validator"]["audit"]
    assert st["fail"] == 0 and st["unavailable"] == 0, st
    assert st["windows"]["fail"] == 0 and st["windows"]["unavailable"] == 0, st
    late = audited.verdicts["auditor"]
    assert late and all(v["outcome"] == "pass" and v["expected"] == v["published"] for v in late)
    start = int(late[0]["window"])
    assert start >= 2, f"the first window starts at v{start}, not at a later checkpoint"
    ends = [int(v["version"]) for v in late if int(v["version"]) >= start + 2]
    assert ends, f"no record at the window's end (v{start + 2}) passed: {late}"

    # 3. the receipts: the honest worker's batches trained, the cheat's refused
    taken = [w for r in audited.records.values() for w in r["taken"].values()]
    assert ids["w1"] in taken and ids["c1"] not in taken
    assert honest["trainer"]["trainer"]["rejected_batches"] >= 1, honest["trainer"]["trainer"]

    # 4. every node: passing, both auditors heard, nothing refused
    for name in NODES:
        a = honest[name]["snapshot"]["audits"]
        assert a["state"] == "passing" and a["failed"] == 0 and a["unavailable"] == 0, (name, a)
        assert not a["refusing"] and a["first_failed"] is None and a["heard_from"] == 2, (name, a)
        assert a["required"] and a["last_verdict_age_s"] is not None, (name, a)
    for name in ("trainer", "validator", "auditor", "w1"):
        assert honest[name]["health"]["state"] == "running", (name, honest[name]["health"])

    # 5. the run went on while it was audited: the worker on newer policies, with more batches
    before, after = audited.before, audited.after
    assert after["policy_version"] > before["policy_version"] and after["batches"] > before["batches"]
    assert not after["audit_refusal"]


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


def test_a_nudging_trainer_is_caught_by_both_auditors_and_not_followed(audited: Audited) -> None:
    tmp, run, sw = audited.root, audited.run, audited.sw
    procs = audited.procs
    trainer, validator, auditor, worker = procs["trainer"], procs["validator"], procs["auditor"], procs["w1"]
    (tmp / "trainer" / CUE).touch()
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
        mine = verdicts(tmp / name)
        k = [v["outcome"] for v in mine].index("fail")
        assert all(v["outcome"] == "pass" for v in mine[:k]) and mine[k]["seq"] == bad["seq"], mine
        seqs.add(int(bad["seq"]))
    first_window = int(verdicts(tmp / "auditor")[0]["window"])
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
        assert _check_evidence(tmp / name, ids["trainer"], auditors) == seq
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
    worker = run.start("w1", "worker", bootstrap=[sw.t_addr, sw.v_addr])
    listen_addr(worker)
    assert _refusing(worker, "worker"), audits_seen(worker)
    wait_for(lambda: role_status(worker, "worker")["refused_announcements"] >= 3, timeout=120,
             what="the restarted worker refusing three announcements")
    st = role_status(worker, "worker")
    assert st["batches"] == 0 and st["withheld"] == 0, st
