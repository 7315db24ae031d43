"""Accepted work survives a trainer that was down when its verdict was gossiped.

Gossip keeps nothing for a peer that is not connected: a verdict a validator publishes while the trainer
is down reaches no one, and that batch, accepted and acknowledged to its worker, would never be trained.
The validator keeps its recent accepted verdicts and gossips them again when it hears the trainer after a
silence; the trainer ignores those it already holds. Checked: every batch the worker's ledger shows as
accepted ends up held by the restarted trainer (in its inbox, or named by a step in metrics.jsonl).

In one process (``intellect_node.testing.roles``): the trainer is stopped (it hears nothing, serves
nothing) and a new one started on its data dir. That the inbox and journal outlive a SIGKILL is
``test_roles_admission.py``'s and ``tests/system/test_chaos.py``'s.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config.ledger import Ledger
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator import role as validator_role
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.wait import wait_until

RL = dict(group_size=4, problems_per_batch=2, groups_per_step=64, max_new_tokens=4, batches_per_version=64)
"""Steps of 64 groups: the trainer queues what it admits and steps rarely, so held batches stay in its
inbox where the test can see them."""
SILENCE_S = 5.0
"""The validator's ``HEARD_RECENTLY_S`` here: still over twice the trainer's repeat of its announcement
(``publication.REANNOUNCE_S``), so only a trainer that is down counts as silent."""


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


def test_verdicts_issued_while_the_trainer_was_down_reach_it_when_it_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validator_role, "HEARD_RECENTLY_S", SILENCE_S)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL)
    worker_dir, trainer_dir = tmp_path / "worker", tmp_path / "trainer"

    async def main() -> tuple[set[str], dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            validator = await net.start("validator", cfg, Validator.for_runtime)
            worker = await net.start("worker", cfg, Worker.for_runtime)
            await wait_until(lambda: trainer.status()["accepted_batches"] >= 1, timeout=300,
                             what="a first batch at the trainer")
            await trainer.close()
            before = _accepted_at_worker(worker_dir)
            # Verdicts gossiped to no trainer, and a silence the validator notices.
            await wait_until(lambda: len(_accepted_at_worker(worker_dir) - before) >= 2
                             and (validator.status()["trainer_silent_s"] or 0) > SILENCE_S,
                             timeout=300, what="two batches accepted while the trainer is down")
            missed = _accepted_at_worker(worker_dir) - before
            assert not missed & _held_by_trainer(trainer_dir)

            await net.start("trainer", cfg, Trainer.for_runtime)
            await wait_until(lambda: missed <= _held_by_trainer(trainer_dir), timeout=120,
                             what="the batches accepted while the trainer was down, at the restarted trainer")
            assert not net.failures(), net.failures()
            return missed, validator.status(), worker.status()

    missed, vstat, wstat = asyncio.run(main())
    assert vstat["resent"] >= len(missed), vstat
    assert vstat["rejected"] == 0 and wstat["rejected"] == 0, (vstat, wstat)
