"""A run with an off-policy loss, warmup and the target-KL step is audited pass by pass, by a validator
whose ``rl.micro_batch_tokens`` is not the trainer's.

In one process (``intellect_node.testing.roles``): the trainer (``rl.loss`` "mis", ``lr_warmup_steps`` 3,
``target_kl``, micro-batches of 64 padded tokens), an auditing validator with the default 16384 and one
worker working one version ahead (so the trainer's batches are stale and the controller measures a KL).
Checked: every step the auditor replayed passed, each record's lr follows the warmup, and the scale moved.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from intellect_node.fsutil import read_jsonl
from intellect_node.roles.trainer.metrics import METRICS_FILE
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.wait import wait_until

RL: dict[str, Any] = dict(group_size=8, problems_per_batch=4, groups_per_step=4, max_new_tokens=5,
                          batches_per_version=2, work_ahead=1, checkpoint_every=1000, ban_after=1000, lr=5e-4,
                          loss="mis", lr_warmup_steps=3, target_kl=1e-4)
STEPS = 5


def test_an_off_policy_loss_with_a_scheduled_lr_passes_an_auditor_with_other_micro_batches(
        tmp_path: Path) -> None:
    ids: dict[str, Any] = dict(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id])
    t_cfg = run_config(**ids, rl={**RL, "micro_batch_tokens": 64})
    v_cfg = run_config(**ids, rl=RL).model_copy(
        update={"validator": run_config(**ids, rl=RL).validator.model_copy(update={"audit": True})})

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", t_cfg, Trainer.for_runtime)
            validator = await net.start("validator", v_cfg, Validator.for_runtime)
            await net.start("w", t_cfg, Worker.for_runtime)

            def audit() -> dict[str, Any]:
                st = validator.status()["audit"]
                assert isinstance(st, dict)
                return st

            await wait_until(lambda: trainer.role.step >= STEPS and audit()["last"].get("version", 0) >= STEPS
                             or audit()["fail"] + audit()["unavailable"] > 0, timeout=300,
                             what=f"{STEPS} trained steps audited")
            assert not net.failures(), net.failures()
            return audit(), trainer.status()

    audit, _ = asyncio.run(main())
    assert audit["fail"] == 0 and audit["unavailable"] == 0 and audit["pass"] >= STEPS, audit
    lines: list[dict[str, Any]] = [m for m in read_jsonl(tmp_path / "trainer" / "trainer" / METRICS_FILE)
                                   if m["trained"]]
    lrs = [m["lr"] for m in lines]
    assert lrs[0] == 5e-4 / 3 and lrs[1] == 5e-4 * 2 / 3, lrs  # the warmup, as the records say it
    # the controller moves the scale after a step that trained on a batch older than its base (here the
    # KL per token is far above the target: the scale halves)
    moved = next((i + 1 for i, m in enumerate(lines[:-1]) if max(m["batch_ages"]) > 0), None)
    assert moved is None or lrs[moved] < 5e-4 * min(1.0, (moved + 1) / 3), (lrs, lines)
    assert all(m["loss_kind"] == "mis" and m["kl_sampler"] >= 0 for m in lines)
