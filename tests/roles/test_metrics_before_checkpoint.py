"""A trained step's line is in ``metrics.jsonl`` before the checkpoint that covers it is written.

The other order loses the line for good when the trainer is killed between the two: the restart resumes
from that checkpoint, so no journal replay records the step (seen once in ``test_chaos.py``: the first
step after a restart was v21 with v19 the last line, v20 checkpointed but never recorded).

Real processes on loopback: the trainer runs as this module's ``__main__``, a trainer node in every way
but one hook, which notes at each checkpoint (``rl.checkpoint_every`` 2) the version it commits and the
version of the last line in ``metrics.jsonl`` at that moment; a validator and a worker feed it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.roles import ENV, role_run, write_config
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

SEEN = "checkpoints-seen.jsonl"
"""In the trainer's data dir: one line per checkpoint, ``{"version": v, "recorded": last line's version}``."""


@pytest.mark.slow
def test_each_checkpointed_step_has_its_metrics_line_before_the_checkpoint(tmp_path: Path) -> None:
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
              work_ahead=1, checkpoint_every=2)
    seen = tmp_path / "trainer" / SEEN
    with role_run(tmp_path, ("trainer", "validator", "w"), rl=rl) as run:
        write_config(tmp_path / "trainer", **run.common)
        trainer = NodeProcess(tmp_path / "trainer", env=ENV,
                              argv=[sys.executable, "-m", "tests.roles.test_metrics_before_checkpoint",
                                    str(tmp_path / "trainer")])
        _, t_addr, _, v_addr = run.trainer_and_validator(trainer)
        run.start("w", "worker", bootstrap=[t_addr, v_addr])
        wait_for(lambda: seen.exists() and len(seen.read_text().splitlines()) >= 3, timeout=300,
                 what="three checkpoints after trained steps")
    noted = [json.loads(x) for x in seen.read_text().splitlines()]
    assert [n["version"] for n in noted[:3]] == [2, 4, 6], noted  # every second version (v0: at start)
    for n in noted:
        assert n["recorded"] == n["version"], noted  # the step that made it was recorded first


def _trainer_main(data_dir: Path) -> int:
    from intellect_node.fsutil import read_jsonl
    from intellect_node.roles.trainer.metrics import METRICS_FILE
    from intellect_node.roles.trainer.role import Trainer
    from tests.support.roles import run_custom_node

    class Observed(Trainer):
        async def _checkpoint(self, publish: bool = False) -> Any:
            lines = read_jsonl(self.dir / METRICS_FILE) if (self.dir / METRICS_FILE).exists() else []
            recorded = max((int(m["version"]) for m in lines if m.get("trained")), default=None)
            with open(data_dir / SEEN, "a") as f:
                f.write(json.dumps({"version": self.version, "recorded": recorded}) + "\n")
            return await super()._checkpoint(publish)

    return run_custom_node(data_dir, "trainer", [Observed.for_runtime])


if __name__ == "__main__":
    sys.exit(_trainer_main(Path(sys.argv[1])))
