"""A short real run in one process (``intellect_node.testing.roles``): a trainer, a validator and a worker
on the embedded model until the trainer has checkpointed a few trained versions. What the trainer's data
dir then holds (``trainer/checkpoints/``, ``trainer/policy/``, ``trainer/metrics.jsonl``, the ledgers) is
what ``model export`` and ``run report`` read in their tests."""

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

RL = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
          work_ahead=1, checkpoint_every=2)


def trained_run(root: Path, *, steps: int = 4) -> Path:
    """Run until ``steps`` trained steps are in the trainer's metrics and their versions checkpointed;
    the root of the nodes' data dirs (``trainer``, ``validator``, ``w``)."""
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL)
    metrics = root / "trainer" / "trainer" / METRICS_FILE
    checkpoints = root / "trainer" / "trainer" / "checkpoints"

    def done() -> bool:
        lines: list[dict[str, Any]] = read_jsonl(metrics) if metrics.exists() else []
        trained = [m for m in lines if m.get("trained")]
        newest = max((int(m["version"]) for m in trained), default=-1)
        return len(trained) >= steps and (checkpoints / f"v{newest:08d}").is_dir()

    async def main() -> None:
        async with in_process_swarm(root) as net:
            await net.start("trainer", cfg, Trainer.for_runtime)
            await net.start("validator", cfg, Validator.for_runtime)
            await net.start("w", cfg, Worker.for_runtime)
            await wait_until(done, timeout=300, what=f"{steps} trained steps, the last checkpointed")
            assert not net.failures(), net.failures()

    asyncio.run(main())
    return root
