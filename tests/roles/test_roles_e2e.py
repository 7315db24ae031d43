"""The swarm learns: trainer, validator, two honest workers and a cheating worker as real processes on
loopback, on the embedded model.

One run checks, in order:
- the swarm learns: steps happen on accepted work only, with staleness within ``async_level``, and the
  trainer's final policy samples correct answers clearly more often than the starting model on 512 fixed
  held-out problems (``inference/evaluate.py``; the per-step pass rate swings too much to assert on);
- honest work is never rejected; the cheater's batches (inflated reward, edited tokens, another model,
  in turn) are rejected with the matching reasons and it is banned after ``ban_after`` rejections,
  after which its notices are dropped (no further verdicts) while the run goes on;
- the trainer, SIGKILLed mid-run between checkpoints (``checkpoint_every`` 4) and restarted, resumes
  from its checkpoint, replays the journaled steps since then to bit-identical weights (the newest
  version it announced comes out with the announced hash), continues the version numbering without a
  gap or a repeat and never records a batch as trained twice.

``RISE`` is set from measured runs of these settings (bench/README.md, "learning").
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from intellect_node.inference.evaluate import pass_rate, with_weights
from intellect_node.models.loader import load_model
from intellect_node.trainer.checkpoint import latest_weights_path
from tests.support.roles import role_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

RL = dict(group_size=8, problems_per_batch=4, groups_per_step=8, max_new_tokens=5, lr=2e-4,
          batches_per_version=2, ban_after=3, checkpoint_every=4)
BEFORE_KILL = 3  # trained steps before the trainer is killed (between the checkpoints of v0 and v4)
TOTAL = 40  # trained steps in all
RISE = 0.20  # held-out pass rate gain required (measured: 0.27 -> 0.62-0.65 in 40 steps)


def _metrics(trainer_dir: Path) -> list[dict[str, Any]]:
    path = trainer_dir / "trainer" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trained(trainer_dir: Path) -> list[dict[str, Any]]:
    return [m for m in _metrics(trainer_dir) if m["trained"]]


def _latest_version(trainer_dir: Path) -> int:
    name = (trainer_dir / "trainer" / "checkpoints" / "LATEST").read_text().strip()
    return int(name[1:])


def test_swarm_learns_rejects_cheats_and_survives_a_trainer_sigkill(tmp_path: Path) -> None:
    with role_run(tmp_path, ("trainer", "validator", "w1", "w2", "cheat"), rl=RL) as run:
        ids = run.ids
        trainer, t_addr, validator, v_addr = run.trainer_and_validator()
        w1, w2 = [run.start(n, "worker", bootstrap=[t_addr, v_addr]) for n in ("w1", "w2")]
        cheat = run.cheat("cheat", "mix", bootstrap=[t_addr, v_addr])

        wait_for(lambda: len(_trained(tmp_path / "trainer")) >= BEFORE_KILL, timeout=600,
                 what=f"{BEFORE_KILL} trained steps")
        trainer.signal(signal.SIGKILL)
        trainer.wait(30)
        v_ckpt = _latest_version(tmp_path / "trainer")
        n_before = len(_metrics(tmp_path / "trainer"))
        v_recorded = max(m["version"] for m in _trained(tmp_path / "trainer"))

        # Restart on the same data dir; the old address is gone, so bootstrap through the validator.
        trainer2 = run.start("trainer", "trainer", bootstrap=[v_addr])
        trainer2.wait_ready(180)
        # From the checkpoint, then the journal replayed up to at least the last version recorded.
        st2 = trainer2.status()["trainer"]
        assert st2["version"] >= v_recorded
        assert f"resumed at policy v{v_ckpt} " in trainer2.log_path.read_text(errors="replace")
        if v_recorded > v_ckpt:  # killed between checkpoints: the replay reproduced what was announced
            assert st2["replay"]["outcome"] == "identical", st2["replay"]

        wait_for(lambda: len(_trained(tmp_path / "trainer")) >= TOTAL, timeout=900,
                 what=f"{TOTAL} trained steps")
        vstat = validator.status()["validator"]
        w_stats = [w.status()["worker"] for w in (w1, w2)]
        cstat = cheat.status()["worker"]

    metrics = _metrics(tmp_path / "trainer")
    trained = [m for m in metrics if m["trained"]]

    assert all(0.0 <= m["pass_rate"] <= 1.0 and m["samples"] == 64 for m in trained)

    # It learned: the final policy against the starting one, same problems, same sampler keys.
    base = load_model(None)
    last = latest_weights_path(tmp_path / "trainer" / "trainer" / "checkpoints")
    assert last is not None
    before, final = pass_rate(base), pass_rate(with_weights(base, last))
    print(f"held-out pass rate {before:.3f} -> {final:.3f} after {len(trained)} steps")
    assert final >= before + RISE, (before, final)

    # Same version numbering across the kill, no version twice, no batch trained twice.
    versions = [m["version"] for m in trained]
    assert versions == sorted(set(versions)), versions
    after = [m for m in metrics[n_before:] if m["trained"]]
    assert after and after[0]["version"] == v_recorded + 1
    seen: set[str] = set()
    for m in metrics:
        assert not seen & set(m["batches"]), "a batch was trained twice"
        seen |= set(m["batches"])
    assert all(m["staleness_max"] <= 2 for m in trained)  # async_level 2

    # Honest work is never rejected; the cheater is rejected for what it did and banned.
    rejected_workers = set(vstat["rejections_by_worker"])
    assert rejected_workers == {ids["cheat"]}, vstat
    assert all(s["rejected"] == 0 and s["accepted"] > 0 for s in w_stats), w_stats
    reasons = vstat["reasons_by_worker"][ids["cheat"]]
    # Its batches cheat in turn (reward, tokens, model); one may go stale unjudged (not held against it),
    # so the counted ones are a run of that cycle with gaps: both kinds of check caught it.
    proofs = {"toploc", "logprob", "sampling"}
    assert len(reasons) == RL["ban_after"] and set(reasons) <= proofs | {"reward"}, reasons
    assert "reward" in reasons and proofs & set(reasons), reasons
    assert vstat["banned"] == 1
    # Banned: its later batches drew no verdicts (dropped at the gossip validator), the run went on.
    assert cstat["batches"] > RL["ban_after"] and cstat["rejected"] <= RL["ban_after"], cstat
