"""Dishonest trainers, each caught at the first step that holds its change, and shown failed on every node.

Each test is one run in one process (``intellect_node.testing.roles``: the real roles, the embedded model,
gossip through the swarm's validate-then-handle steps, blobs over HTTP on 127.0.0.1): a trainer from
``tests/support/dishonest_trainer.py``, its validator with ``validator.audit`` on (replaying every step
from version 0, one window: ``rl.checkpoint_every`` 1000) and an honest worker ``w1``, every node with
the node's audit watch:

- ``lr``: trains with twice the run's learning rate while its records state the run's; the first step
  that trained (version 1) fails, with the hash the replay made and the one published;
- ``rejected`` (beside a worker ``c1`` whose batches the validator rejects: it claims reward 1.0 for every
  rollout): takes a rejection as an acceptance; the first step that took one of ``c1``'s batches fails
  on its evidence, a rejection by the validator naming ``c1``;
- ``drop`` (``run.async_level`` 1: a batch's deadline comes two versions after it): silently drops the
  first batch its validator accepted, named by no record; the first step from that batch's deadline on
  fails, naming the batch;
- ``claim``: drops the first batch its validator accepted (an honest worker's assigned window) and names
  it in its next record as dropped ``not_assigned``; that record fails, naming the batch: the auditor
  fetched it and the trainer's own check takes it.

In each, every step before the failed one passed, the auditor stops, and every node (trainer, validator,
workers) shows the audit ``failed`` at that step (``run.require_audits`` off: nothing stops).

A trainer turning dishonest under a swarm of real processes, caught by two auditors (one from a
checkpoint fetched through the swarm) and refused from evidence after a restart, is
``test_audit_nudge.py``'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import InProcessNode, in_process_swarm, key_of, run_config
from tests.support.audit_run import RL, records, verdicts
from tests.support.dishonest_trainer import dishonest
from tests.support.roles import cheater
from tests.support.wait import wait_until


def _shows_failed(node: InProcessNode, seq: int) -> bool:
    """Whether the node's status shows the trainer failed the audit, its first failed step ``seq`` (the
    snapshot's ``audits``, which the node's audit watch publishes)."""
    a = node.board.snapshot().audits
    return a.state == "failed" and a.first_failed is not None and a.first_failed.seq == seq


def _caught(tmp: Path, mode: str, *, cheat: bool = False, **run: Any
            ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str], dict[str, Any]]:
    """Run ``mode``'s trainer until its auditor stopped and every node shows the failed step: the
    auditor's first bad verdict, its verdicts, the peer IDs and the trainer's status."""
    names = ("trainer", "validator", "w1", "c1") if cheat else ("trainer", "validator", "w1")
    ids = {n: key_of(n).peer_id for n in names}
    cfg = run_config(trainer=ids["trainer"], validators=[ids["validator"]], rl=RL, **run)
    v_cfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update={"audit": True})})

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp) as net:
            trainer = await net.start("trainer", cfg, dishonest(mode).for_runtime, audits=True)
            validator = await net.start("validator", v_cfg, Validator.for_runtime, audits=True)
            nodes = [trainer, validator, await net.start("w1", cfg, Worker.for_runtime, audits=True)]
            if cheat:
                nodes.append(await net.start("c1", cfg, cheater("reward").for_runtime, audits=True))

            def audit() -> dict[str, Any]:
                st = validator.status()["audit"]
                assert isinstance(st, dict), st
                return st

            await wait_until(lambda: audit()["state"] == "stopped", timeout=300, what="the audit stopped")
            st = audit()
            seq = int(st["first_bad"]["seq"])
            await wait_until(lambda: all(_shows_failed(n, seq) for n in nodes), timeout=120,
                             what=f"every node showing step {seq} failed")
            assert not net.failures(), net.failures()
            return st, trainer.status()

    st, t_status = asyncio.run(main())
    mine = verdicts(tmp / "validator")
    assert st["fail"] == 1 and st["first_bad"]["outcome"] == "fail", st
    assert [v["outcome"] for v in mine] == ["pass"] * (len(mine) - 1) + ["fail"], mine
    return st["first_bad"], mine, ids, t_status


def test_trainer_with_another_learning_rate_is_caught(tmp_path: Path) -> None:
    bad, mine, _, _ = _caught(tmp_path, "lr")
    assert bad["expected"] and bad["expected"] != bad["published"], bad
    assert "replayed weights differ" in str(bad["reason"]), bad
    # the first step that trained: every step before it trained nothing (each kept version 0)
    assert int(bad["version"]) == 1 and all(int(v["version"]) == 0 for v in mine[:-1]), mine


def test_trainer_training_on_rejected_batch_is_caught(tmp_path: Path) -> None:
    bad, _, ids, _ = _caught(tmp_path, "rejected", cheat=True, async_level=1)
    assert "was rejected by validator" in str(bad["reason"]) and ids["c1"] in str(bad["reason"]), bad
    recs = records(tmp_path / "trainer")
    first = min(seq for seq, r in recs.items() if ids["c1"] in r["taken"].values())
    assert bad["seq"] == first, (bad, recs)


def test_trainer_dropping_accepted_batch_is_caught(tmp_path: Path) -> None:
    bad, _, _, t_status = _caught(tmp_path, "drop", async_level=1)
    cid = t_status["dropped_silently"]
    assert cid, t_status
    reason = str(bad["reason"])
    assert f"accepted batch {cid}" in reason and "never trained nor recorded" in reason, bad
    recs = records(tmp_path / "trainer")
    assert all(cid not in r["named"] for r in recs.values())
    # The first batch accepted is of version 0, heard before any record: its deadline is base version 2
    # (0 + async_level 1 + 1). Caught at the first record from that base on, not later.
    assert bad["seq"] == min(seq for seq, r in recs.items() if r["base"] >= 2), (bad, recs)


def test_trainer_dropping_accepted_batch_as_not_assigned_is_caught(tmp_path: Path) -> None:
    bad, _, _, t_status = _caught(tmp_path, "claim")
    cid = t_status["dropped_claimed"]
    assert cid, t_status
    reason = str(bad["reason"])
    assert f"batch {cid}" in reason and "(not_assigned)" in reason and "own check takes it" in reason, bad
    recs = records(tmp_path / "trainer")
    assert bad["seq"] == min(seq for seq, r in recs.items() if cid in r["named"]), (bad, recs)
