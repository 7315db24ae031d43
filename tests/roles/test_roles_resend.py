"""Accepted work survives a trainer that was down when its verdict was gossiped (real processes).

Gossip keeps nothing for a peer that is not connected: a verdict a validator publishes while the trainer
is dead reaches no one, and that batch, accepted and acknowledged to its worker, would never be trained.
The validator keeps its recent accepted verdicts and gossips them again when it hears the trainer after a
silence; the trainer ignores those it already holds. Checked: every batch the worker's ledger shows as
accepted ends up held by the restarted trainer (in its inbox, or named by a step in metrics.jsonl).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from intellect_node.config.ledger import Ledger
from intellect_node.roles.validator.role import HEARD_RECENTLY_S
from tests.support.roles import role_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RL = dict(group_size=4, problems_per_batch=2, groups_per_step=64, max_new_tokens=4, batches_per_version=64)
"""Steps of 64 groups: the trainer queues what it admits and steps rarely, so held batches stay in its
inbox where the test can see them."""


def _accepted_at_worker(worker_dir: Path) -> set[str]:
    with Ledger.in_data_dir(worker_dir, readonly=True) as led:
        return {r["batch_id"] for r in led.recent(10_000) if r["accepted"] > 0}


def _held_by_trainer(trainer_dir: Path) -> set[str]:
    held = {p.name.removesuffix(".batch") for p in (trainer_dir / "trainer" / "inbox").glob("*.batch")}
    metrics = trainer_dir / "trainer" / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            held |= set(json.loads(line)["batches"])
    return held


def test_verdicts_issued_while_the_trainer_was_down_reach_it_when_it_returns(tmp_path: Path) -> None:
    with role_run(tmp_path, ("trainer", "validator", "worker"), rl=RL) as run:
        trainer, t_addr, validator, v_addr = run.trainer_and_validator()
        worker = run.start("worker", "worker", bootstrap=[t_addr, v_addr])
        wait_for(lambda: trainer.status()["trainer"]["accepted_batches"] >= 1, timeout=300,
                 what="a first batch at the trainer")
        trainer.signal(signal.SIGKILL)
        trainer.wait(30)
        before = _accepted_at_worker(tmp_path / "worker")
        # Verdicts gossiped to no trainer, and a silence the validator notices.
        wait_for(lambda: len(_accepted_at_worker(tmp_path / "worker") - before) >= 2
                 and (validator.status()["validator"]["trainer_silent_s"] or 0) > HEARD_RECENTLY_S,
                 timeout=300, what="two batches accepted while the trainer is down")
        missed = _accepted_at_worker(tmp_path / "worker") - before
        assert not missed & _held_by_trainer(tmp_path / "trainer")

        trainer2 = run.start("trainer", "trainer", bootstrap=[v_addr])
        trainer2.wait_ready(180)
        wait_for(lambda: missed <= _held_by_trainer(tmp_path / "trainer"), timeout=120,
                 what="the batches accepted while the trainer was down, at the restarted trainer")
        vstat = validator.status()["validator"]
        wstat = worker.status()["worker"]
    assert vstat["resent"] >= len(missed), vstat
    assert vstat["rejected"] == 0 and wstat["rejected"] == 0, (vstat, wstat)
