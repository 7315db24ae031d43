"""``metrics.jsonl`` keeps its keys and their order: a trained step's line is :class:`StepLine`, whole.

In one process (``intellect_node.testing.roles``): trainer, validator and one worker on the embedded model
until two steps trained. The expected keys are written out here, not read from ``StepLine``, so a change
to the typed line that would change what readers of the file see (``run report``, the mirrors, scripts)
fails here first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import get_type_hints

from intellect_node.fsutil import read_jsonl
from intellect_node.roles.trainer.metrics import METRICS_FILE, StepLine, StepTiming
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.wait import wait_until

KEYS = ["step", "version", "trained", "time", "seq", "pass_rate", "reward_mean", "samples", "groups",
        "groups_used", "filtered_fraction", "no_signal", "loss", "grad_norm", "clipped_frac", "kl_sampler",
        "ratio_mean", "ratio_max", "lr", "entropy", "loss_kind", "staleness_mean", "staleness_max",
        "batch_ages", "accepted", "rejected", "stale", "idle_fraction", "batches", "hops", "published"]
"""An attempt's keys in the order the trainer writes them."""
TIMING = ["train_s", "publish_wait_s", "checkpoint_s", "publish_s", "taken_t", "trained_t"]
"""What a trained step's line adds at its end."""


def test_the_typed_line_declares_the_keys_the_file_has_always_had() -> None:
    assert list(get_type_hints(StepLine)) == KEYS + TIMING
    assert list(get_type_hints(StepTiming)) == TIMING


def test_a_trained_steps_line_has_every_key_in_order(tmp_path: Path) -> None:
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl)
    path = tmp_path / "trainer" / "trainer" / METRICS_FILE

    def trained() -> int:
        return sum(1 for m in read_jsonl(path) if m.get("trained")) if path.exists() else 0

    async def main() -> None:
        async with in_process_swarm(tmp_path) as net:
            await net.start("trainer", cfg, Trainer.for_runtime)
            await net.start("validator", cfg, Validator.for_runtime)
            await net.start("w", cfg, Worker.for_runtime)
            await wait_until(lambda: trained() >= 2, timeout=300, what="two trained steps")
            assert not net.failures(), net.failures()

    asyncio.run(main())
    lines = read_jsonl(path)
    for m in lines:
        assert list(m) == (KEYS + TIMING if m["trained"] else KEYS), m
    line = next(m for m in lines if m["trained"])
    assert isinstance(line["hops"], dict) and isinstance(line["published"], dict), line
    assert all(isinstance(line[k], float) for k in TIMING), line
