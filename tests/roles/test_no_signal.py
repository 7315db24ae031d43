"""A run that cannot learn says so: every reward 0, so every group is filtered and no step trains.

In one process (``intellect_node.testing.roles``): trainer, validator and one worker on the embedded
model, with ``rl.answer_format = "answer_tags"``, which the embedded model never writes (it writes
digits): every completion has no answer and scores 0. Within its first few step attempts the trainer's
status snapshot carries the not-learning warning with the cause and the settings to check, counts the
attempts by cause, shows the completions it re-scored (no answer found, the expected one), and exports the
same counts on ``/metrics`` (its registry, read as the text the route serves); its ``metrics.jsonl``
records each attempt as untrained with the cause. The batches are consumed (not left queued) and no
version is published.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from intellect_node.config.status import NO_SIGNAL_ATTEMPTS, StatusBoard, StatusSnapshot
from intellect_node.fsutil import read_jsonl
from intellect_node.node.metrics import build_registry
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.wait import wait_until

RL = dict(group_size=4, problems_per_batch=2, groups_per_step=1, max_new_tokens=4, batches_per_version=1,
          answer_format="answer_tags")
"""One batch a version, one batch an attempt: every attempt after the first is fed by the batch the
previous attempt's step record gave back to the worker (``roles/worker/pacing.py``)."""


def _snapshot(board: StatusBoard) -> StatusSnapshot:
    return StatusSnapshot.from_json(board.snapshot().to_json())  # as a status answer carries it


def _metrics(board: StatusBoard) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(build_registry(board)).decode()  # what GET /metrics serves
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_run_whose_rewards_are_all_zero_says_why_it_is_not_learning(tmp_path: Path) -> None:
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL)

    async def main() -> tuple[StatusSnapshot, Any, StatusSnapshot, int, dict[str, int]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            await net.start("validator", cfg, Validator.for_runtime)
            worker = await net.start("w", cfg, Worker.for_runtime)
            await wait_until(lambda: _snapshot(trainer.board).training.no_signal_warning, timeout=300,
                             what="the trainer's not-learning warning")
            assert not net.failures(), net.failures()
            return (_snapshot(trainer.board), _metrics(trainer.board), _snapshot(worker.board),
                    trainer.status()["queued_batches"], worker.status()["pacing"])

    s, metrics, w, queued, pacing = asyncio.run(main())
    t = s.training
    # the warning came with the first attempts that could not learn, and says why and what to check
    assert NO_SIGNAL_ATTEMPTS <= t.no_signal_streak == t.no_signal_attempts == t.attempts, t
    assert "every reward 0" in t.no_signal_warning and "rl.answer_format answer_tags" in t.no_signal_warning
    assert "rl.max_new_tokens 4" in t.no_signal_warning
    assert t.no_signal_causes == {"all_zero": t.attempts}
    assert t.groups_seen == t.groups_filtered >= t.attempts and t.filtered_fraction == 1.0
    assert t.step == -1 and s.policy.local == 0  # nothing trained, no version after v0
    # what the trainer re-scored: the worker's completions, no answer found in them, the expected one
    # (a completion's text may be empty: the random tiny model can sample end-of-text first)
    worker_id = key_of("w").peer_id
    assert t.completions and all(c.reward == 0.0 and c.answer is None and c.reason == "no_answer"
                                 and c.expected and isinstance(c.text, str) and c.worker == worker_id
                                 for c in t.completions)
    assert w.training.completions and all(c.reward == 0.0 for c in w.training.completions)
    # the worker made the later attempts' batches because the records gave its batches back
    assert pacing["refilled_no_signal"] >= NO_SIGNAL_ATTEMPTS - 1, pacing
    # /metrics, from the same counters
    assert metrics[("intellect_node_train_attempts_no_signal_total", (("cause", "all_zero"),))] >= \
        NO_SIGNAL_ATTEMPTS
    assert metrics[("intellect_node_not_learning", ())] == 1
    assert metrics[("intellect_node_groups_filtered_fraction", ())] == 1.0
    # every attempt recorded as untrained, its batches consumed, not left to pile up in the queue
    lines = read_jsonl(tmp_path / "trainer" / "trainer" / "metrics.jsonl")
    assert len(lines) >= NO_SIGNAL_ATTEMPTS and queued <= 1
    assert all(not m["trained"] and m["no_signal"] == "all_zero" and m["filtered_fraction"] == 1.0
               and m["version"] == 0 for m in lines), lines
