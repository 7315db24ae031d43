"""``rl.work_ahead``: a worker makes the trainer's next batch while the trainer runs the current step,
one version stale, and never makes more than the trainer takes (docs/training.md, "Working ahead")."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config import load_config
from intellect_node.errors import ConfigError


def test_work_ahead_beyond_the_async_level_is_an_operator_error(tmp_path: Path) -> None:
    ok = tmp_path / "ok.toml"
    ok.write_text("[run]\nasync_level = 1\n[rl]\nwork_ahead = 1\n")
    assert load_config(ok, environ={}).rl.work_ahead == 1
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nasync_level = 1\n[rl]\nwork_ahead = 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad, environ={})
    assert "rl.work_ahead" in str(e.value) and "run.async_level" in str(e.value)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_a_worker_a_version_ahead_feeds_each_step_without_waste(tmp_path: Path) -> None:
    """In one process (``intellect_node.testing.roles``): one worker whose batch is one step's work
    (``groups_per_step`` = ``problems_per_batch``) and ``work_ahead`` 1: it submits two batches on the
    first policy and then one per version, so from the second step on the trainer trains on a batch made
    one version back (made while it ran the step before) and no batch is ever left over as stale."""
    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.roles.validator.role import Validator
    from intellect_node.roles.worker.role import Worker
    from intellect_node.testing.roles import in_process_swarm, key_of, run_config
    from tests.support.wait import wait_until

    rl = dict(group_size=8, problems_per_batch=4, groups_per_step=4, max_new_tokens=5, batches_per_version=1,
              work_ahead=1)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            await net.start("validator", cfg, Validator.for_runtime)
            worker = await net.start("w", cfg, Worker.for_runtime)
            await wait_until(lambda: trainer.status()["step"] >= 6, timeout=300, what="6 trained steps")
            st, pacing = trainer.status(), worker.status()["pacing"]
            assert not net.failures(), net.failures()
            return st, pacing

    st, pacing = asyncio.run(main())
    hops = _lines(tmp_path / "w" / "worker" / "hops.jsonl")
    loaded = [h for h in hops if h["event"] == "loaded"]
    # Version 0 is the model the worker already holds: built from its folder, not fetched
    # (roles/common/policy.py).
    assert (loaded[0]["version"], loaded[0]["path"]) == (0, "local"), loaded[0]
    assert {h["path"] for h in loaded[1:]} == {"delta"}, loaded
    submitted = [h for h in hops if h["event"] == "submitted"]
    first = submitted[0]["version"]
    assert [h["version"] for h in submitted].count(first) == 2, submitted  # the pipeline is filled once
    # credit: two batches to start, one more per version the worker held, and one back for each batch a
    # step consumed without training (every group's rewards equal) or a validator could not judge, or
    # after a stall (worker/pacing.py); never more
    given_back = pacing["refilled_no_signal"] + pacing["refilled_unjudged"] + pacing["stall_batches"]
    bound = 2 + max(h["version"] for h in submitted) - first + given_back
    assert len(submitted) <= bound, (submitted, pacing)
    trained = [m for m in _lines(tmp_path / "trainer" / "trainer" / "metrics.jsonl") if m["trained"]]
    assert trained[0]["staleness_max"] == 0  # the first step: the first batch, on the policy it updates
    assert trained[1]["staleness_max"] == 1, trained[1]  # the second: the batch made beside the first step
    assert st["stale_batches"] == 0, st
    # every accepted batch but those still queued (at most the two a version ahead) went into a step, none
    # older than the one version work_ahead allows
    assert st["accepted_batches"] - st["taken_batches"] <= 2, st
    assert set(st["taken_by_age"]) <= {"0", "1"}, st
