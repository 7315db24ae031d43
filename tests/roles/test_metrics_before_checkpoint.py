"""A trained step's line is in ``metrics.jsonl`` before the checkpoint that covers it is written.

The other order loses the line for good when the trainer is killed between the two: the restart resumes
from that checkpoint, so no journal replay records the step (seen once in ``test_chaos.py``: the first
step after a restart was v21 with v19 the last line, v20 checkpointed but never recorded).

In one process (``intellect_node.testing.roles``): a trainer that is the real role but for one hook,
which notes at each checkpoint (``rl.checkpoint_every`` 2) the version it commits and the version of the
last line in ``metrics.jsonl`` at that moment; a validator and a worker feed it.
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


class Observed(Trainer):
    """The trainer, noting ``(version committed, version of the last trained line)`` at each checkpoint."""

    seen: list[dict[str, Any]]

    async def _checkpoint(self, publish: bool = False) -> Any:
        path = self.dir / METRICS_FILE
        lines: list[dict[str, Any]] = read_jsonl(path) if path.exists() else []
        recorded = max((int(m["version"]) for m in lines if m.get("trained")), default=None)
        self.seen.append({"version": self.version, "recorded": recorded})
        return await super()._checkpoint(publish)


def test_each_checkpointed_step_has_its_metrics_line_before_the_checkpoint(tmp_path: Path) -> None:
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
              work_ahead=1, checkpoint_every=2)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl)
    seen: list[dict[str, Any]] = []

    def observed(rt: Any) -> Observed:
        t = Observed(rt)
        t.seen = seen
        return t

    async def main() -> None:
        async with in_process_swarm(tmp_path) as net:
            await net.start("trainer", cfg, observed)
            await net.start("validator", cfg, Validator.for_runtime)
            await net.start("w", cfg, Worker.for_runtime)
            await wait_until(lambda: len(seen) >= 3, timeout=300,
                             what="three checkpoints after trained steps")
            assert not net.failures(), net.failures()

    asyncio.run(main())
    assert [n["version"] for n in seen[:3]] == [2, 4, 6], seen  # every second version (v0: at start)
    for n in seen:
        assert n["recorded"] == n["version"], seen  # the step that made it was recorded first
