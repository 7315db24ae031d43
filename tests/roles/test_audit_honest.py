"""An honest trainer audited from version 0 and from a later checkpoint: no node ever flags it.

One run of real processes on loopback (the embedded model), with ``run.require_audits`` on,
``run.async_level`` 1 (a batch's deadline comes two versions after it) and ``rl.checkpoint_every`` 2:

- the trainer, honest;
- its validator with ``validator.audit`` on: the first auditor, replaying every step from version 0;
- an honest worker ``w1`` and a worker ``c1`` whose batches the validator rejects (it claims reward 1.0
  for every rollout);
- once the trainer has published a checkpoint's state, a second auditor (a validator named in
  ``run.auditor_peer_ids``, ``audit_fraction`` 1.0) that never heard the steps from version 0: its
  windows start at a later checkpoint, from the weights and optimizer state it fetches through the swarm.

Asserted, once the first auditor passed steps up to version 3 (every batch of version 0 past its
deadline) and the second a whole window:

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
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.audit_run import (
    RL,
    audit_of,
    audits_seen,
    records,
    role_status,
    start_swarm,
    verdicts,
)
from tests.support.roles import listen_addr, role_run
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _passed_version(data_dir: Path) -> int:
    """The newest version an auditor passed (-1: none)."""
    return max((int(v["version"]) for v in verdicts(data_dir) if v["outcome"] == "pass"), default=-1)


def _states(trainer: NodeProcess) -> list[int]:
    """The versions whose checkpoint state the trainer published."""
    return list(role_status(trainer, "trainer")["records"].get("states") or [])


def test_honest_trainer_is_never_flagged(tmp_path: Path) -> None:
    names = ("trainer", "validator", "auditor", "w1", "c1")
    with role_run(tmp_path, names, rl={**RL, "checkpoint_every": 2}, async_level=1, require_audits=True,
                  validator={"audit": True}, auditors=("auditor",)) as run:
        sw = start_swarm(run, cheats=("c1",))
        trainer, validator, worker, cheat = sw.trainer, sw.validator, sw.workers["w1"], sw.workers["c1"]
        wait_for(lambda: bool(_states(trainer)), timeout=600, what="a checkpoint state published")
        before = role_status(worker, "worker")
        auditor = run.start("auditor", "validator", bootstrap=[sw.t_addr, sw.v_addr],
                            validator={"audit": True, "audit_fraction": 1.0})
        listen_addr(auditor)
        nodes = (trainer, validator, auditor, worker, cheat)
        wait_for(lambda: (_passed_version(tmp_path / "validator") >= 3
                          and role_status(trainer, "trainer")["rejected_batches"] >= 1
                          and audit_of(auditor)["windows"]["pass"] >= 1
                          and all(audits_seen(p)["heard_from"] == 2 for p in nodes)),
                 timeout=600, what="steps up to v3 audited from v0, a window from a checkpoint passed, a "
                                   "cheat's batch refused and both auditors heard everywhere")
        after = role_status(worker, "worker")

        # 1. the first auditor, from version 0
        st = audit_of(validator)
        assert st["fail"] == 0 and st["unavailable"] == 0 and st["state"] == "following", st
        first = verdicts(tmp_path / "validator")
        assert first and all(v["outcome"] == "pass" and v["expected"] == v["published"] for v in first)
        assert int(first[0]["window"]) == 0 and st["windows"]["fail"] == 0, (first[0], st)

        # 2. the second auditor, from a checkpoint to the next
        st = audit_of(auditor)
        assert st["fail"] == 0 and st["unavailable"] == 0, st
        assert st["windows"]["fail"] == 0 and st["windows"]["unavailable"] == 0, st
        late = verdicts(tmp_path / "auditor")
        assert late and all(v["outcome"] == "pass" and v["expected"] == v["published"] for v in late)
        start = int(late[0]["window"])
        assert start >= 2, f"the first window starts at v{start}, not at a later checkpoint"
        ends = [int(v["version"]) for v in late if int(v["version"]) >= start + 2]
        assert ends, f"no record at the window's end (v{start + 2}) passed: {late}"

        # 3. the receipts: the honest worker's batches trained, the cheat's refused
        taken = [w for r in records(tmp_path / "trainer").values() for w in r["taken"].values()]
        assert run.ids["w1"] in taken and run.ids["c1"] not in taken

        # 4. every node: passing, both auditors heard, nothing refused
        for proc in nodes:
            a = audits_seen(proc)
            assert a["state"] == "passing" and a["failed"] == 0 and a["unavailable"] == 0, a
            assert not a["refusing"] and a["first_failed"] is None and a["heard_from"] == 2, a
            assert a["required"] and a["last_verdict_age_s"] is not None, a
        for proc in (trainer, validator, auditor, worker):
            assert proc.status()["health"]["state"] == "running", proc.status()["health"]

        # 5. the run went on while it was audited: the worker on newer policies, with more batches
        assert after["policy_version"] > before["policy_version"] and after["batches"] > before["batches"]
        assert not after["audit_refusal"]
