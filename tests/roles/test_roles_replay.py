"""A trainer SIGKILLed between checkpoints (``rl.checkpoint_every`` 4) loses no accepted batch and never
announces a version twice with different content.

Real processes on loopback: trainer, validator and two honest workers on the embedded model. Twice the
trainer is killed while its newest announced version is past its last checkpoint:

1. restarted as it is, it replays its journal (``trainer/steps.jsonl``) over the inbox from the
   checkpoint and reaches the announced version with bit-identical weights (``replay.outcome``
   "identical"); every batch it had admitted before the kill is in its next checkpoint's consumed set or
   still queued in its inbox;
2. restarted after one journaled batch's inbox copy was deleted (what a lost disk block would do), it
   cannot reproduce the announced versions, so it publishes what it holds as the version after the newest
   announced (``replay.outcome`` "bumped").

Throughout, the workers log every announcement they hear (``worker/hops.jsonl``): each version must come
with one content hash only.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from intellect_node.fsutil import read_jsonl
from intellect_node.trainer.checkpoint import latest_dir, read_state
from tests.support.roles import announcements, checkpoint_version, kill_window, role_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

K = 4  # checkpoint_every: the least that leaves a kill window (``kill_window``), so each comes soonest
# Two batches a version: the restarted trainer finds queued work in its inbox, rather than waiting for
# the workers' stall fallback (a verdict the killed trainer missed leaves a capped worker no credit).
RL = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=2,
          checkpoint_every=K, ban_after=1000)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)  # the last line of a killed process is skipped


def _admitted(tmp: Path) -> set[str]:
    """Batches the trainer took in: trained or refused as stale (metrics), or queued (its inbox)."""
    tdir = tmp / "trainer" / "trainer"
    done = {c for m in _jsonl(tdir / "metrics.jsonl") for c in m["batches"]}
    return done | {p.stem for p in (tdir / "inbox").glob("*.json")}


def test_trainer_killed_between_checkpoints_replays_or_bumps(tmp_path: Path) -> None:
    tdir = tmp_path / "trainer" / "trainer"
    with role_run(tmp_path, ("trainer", "validator", "w1", "w2"), rl=RL) as run:
        # Every node launched at once (their start-ups overlap), then each waited for.
        trainer, t_addr, validator, v_addr = run.trainer_and_validator_at_once()
        for n in ("w1", "w2"):
            run.start(n, "worker", bootstrap=[t_addr, v_addr])
        run.wait_ready()

        # 1. Killed between checkpoints: the replay reproduces what was announced.
        wait_for(lambda: kill_window(tmp_path, K), timeout=400,
                 what="a version announced past the checkpoint")
        trainer.signal(signal.SIGKILL)
        trainer.wait(30)
        announced = max(announcements(tmp_path))
        ckpt = checkpoint_version(tmp_path)
        assert ckpt < announced
        before = _admitted(tmp_path)
        trainer2 = run.start("trainer", "trainer", bootstrap=[v_addr])
        trainer2.wait_ready(180)
        st = trainer2.status()
        assert st["trainer"]["replay"]["outcome"] == "identical", st["trainer"]["replay"]
        assert st["trainer"]["version"] >= announced
        # Its next checkpoint holds (or its inbox still queues) every batch admitted before the kill.
        wait_for(lambda: checkpoint_version(tmp_path) > announced, timeout=300,
                 what="a checkpoint after the restart")
        consumed = read_state(latest_dir(tdir / "checkpoints")).consumed  # type: ignore[arg-type]  # set by now
        queued = {p.stem for p in (tdir / "inbox").glob("*.json")}
        assert not before - consumed - queued, "accepted batches lost across the kill"

        # 2. Killed between checkpoints again, and a journaled batch's inbox copy lost: bumped.
        wait_for(lambda: kill_window(tmp_path, K), timeout=300, what="another version past the checkpoint")
        trainer2.signal(signal.SIGKILL)
        trainer2.wait(30)
        announced = max(announcements(tmp_path))
        covered = int(read_state(latest_dir(tdir / "checkpoints")).extra["journal_seq"])  # type: ignore[arg-type]  # set by now
        entry = next(e for e in _jsonl(tdir / "steps.jsonl") if e["seq"] > covered)
        for suffix in (".json", ".batch"):
            (tdir / "inbox" / f"{entry['taken'][0]}{suffix}").unlink()
        trainer3 = run.start("trainer", "trainer", bootstrap=[v_addr])
        trainer3.wait_ready(180)
        st3 = trainer3.status()["trainer"]
        assert st3["replay"]["outcome"] == "bumped", st3["replay"]
        assert st3["version"] >= announced + 1
        wait_for(lambda: max(announcements(tmp_path)) > announced, timeout=120,
                 what="the bumped version heard by the workers")

    # No version was ever announced with two different contents.
    twice = {v: h for v, h in announcements(tmp_path).items() if len(h) > 1}
    assert not twice, twice
