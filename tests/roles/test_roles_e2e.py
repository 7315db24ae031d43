"""The swarm end to end: trainer, validator, two honest workers and a cheating worker as real processes
on loopback, on the embedded model.

One run (a module fixture), every node launched at once, in order:

1. the first worker joins fresh (no key: ``join`` makes one);
2. the trainer is SIGKILLed while its newest announced version is past its last checkpoint
   (``checkpoint_every`` 5) and restarted as it is;
3. once the cheater is banned and has sent a batch past the ban's, it is stopped (what it sends after
   that only costs the others CPU);
4. the swarm trains to ``TOTAL`` steps.

What the tests read from it:

- the swarm learns: steps happen on accepted work only, with staleness within ``async_level``, and the
  trainer's final policy samples correct answers clearly more often than the starting model on 512 fixed
  held-out problems (``inference/evaluate.py``; the per-step pass rate swings too much to assert on);
- honest work is never rejected; the cheater's batches (inflated reward, edited tokens, another model,
  in turn) are rejected with the matching reasons and it is banned after ``ban_after`` rejections,
  after which its notices are dropped (no further verdicts) while the run goes on;
- after the kill the trainer resumes from its checkpoint, replays the journaled steps since then
  (``trainer/steps.jsonl``) to bit-identical weights (``replay.outcome`` "identical": the newest version
  it announced comes out with the announced hash), continues the version numbering without a gap or a
  repeat, never records a batch as trained twice and loses no admitted batch (each is in its next
  checkpoint's consumed set or still queued in its inbox);
- the fresh worker's join timeline, read through ``/v1/status``, ``status --json`` and the human summary.

A second kill with a lost inbox copy (``replay.outcome`` "bumped") is ``test_roles_replay.py``'s.
``RISE`` is set from measured runs of these settings (bench/README.md, "learning"; in process 0.24 -> 0.46
in 20 steps): 30 steps leave it a margin of about twice the run-to-run spread.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config.status import TIMELINE_STAGES
from intellect_node.fsutil import read_jsonl
from intellect_node.inference.evaluate import pass_rate, with_weights
from intellect_node.models.loader import load_model
from intellect_node.trainer.checkpoint import latest_dir, latest_weights_path, read_state
from tests.support.cli import invoke_cli
from tests.support.roles import announcements, checkpoint_version, kill_window, role_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

K = 5  # checkpoint_every
RL = dict(group_size=8, problems_per_batch=4, groups_per_step=8, max_new_tokens=5, lr=2e-4,
          batches_per_version=2, ban_after=3, checkpoint_every=K)
TOTAL = 30  # trained steps in all
RISE = 0.15  # held-out pass rate gain required (measured: 0.27 -> 0.55 in 32 steps, 0.65 in 42)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)  # the last line of a killed process is skipped


def _metrics(tmp: Path) -> list[dict[str, Any]]:
    return _jsonl(tmp / "trainer" / "trainer" / "metrics.jsonl")


def _trained(tmp: Path) -> list[dict[str, Any]]:
    return [m for m in _metrics(tmp) if m["trained"]]


def _admitted(tmp: Path) -> set[str]:
    """Batches the trainer took in: trained or refused as stale (metrics), or queued (its inbox)."""
    tdir = tmp / "trainer" / "trainer"
    done = {c for m in _metrics(tmp) for c in m["batches"]}
    return done | {p.stem for p in (tdir / "inbox").glob("*.json")}


@dataclass
class Run:
    """What the module's run saw, section by section (see the module docstring)."""

    root: Path
    ids: dict[str, str]
    # 1. the fresh worker's join
    launched: float = 0.0
    timeline: dict[str, Any] = field(default_factory=dict)
    cli_timeline: dict[str, Any] = field(default_factory=dict)
    human: str = ""
    trainer_timeline: dict[str, Any] = field(default_factory=dict)
    # 2. the first kill: restarted as it was
    ckpt1: int = -1
    announced1: int = -1
    recorded1: int = -1
    """The newest trained version in the metrics at the kill."""
    n_before1: int = 0
    """Metrics lines at the kill."""
    resumed: dict[str, Any] = field(default_factory=dict)
    resumed_log: str = ""
    lost: set[str] = field(default_factory=set)
    """Batches admitted before the kill in neither the next checkpoint's consumed set nor the inbox."""
    # 3. the cheater when it was stopped
    cstat: dict[str, Any] = field(default_factory=dict)
    # 4. the swarm at TOTAL steps (metrics and weights: when it stopped)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    weights: Path | None = None
    vstat: dict[str, Any] = field(default_factory=dict)
    w_stats: list[dict[str, Any]] = field(default_factory=list)


def _timeline(rec: Run, w1: Any, trainer: Any) -> None:
    """Section 1, read once the run is under way (a mark is set once and never moves): the fresh worker's
    timeline as ``/v1/status``, ``status --json`` and the human summary give it; the trainer's."""
    def accepted() -> dict[str, Any] | None:
        st = w1.status()
        return st if st["snapshot"]["timeline"]["first_batch_accepted"] is not None else None
    st: Any = wait_for(accepted, timeout=400, interval=0.5, what="the fresh worker's first accepted batch")
    rec.timeline = st["snapshot"]["timeline"]
    cli = invoke_cli("status", "--data-dir", str(rec.root / "w1"), "--json")
    assert cli.returncode == 0, cli.stderr
    rec.cli_timeline = json.loads(cli.stdout)["snapshot"]["timeline"]
    human = invoke_cli("status", "--data-dir", str(rec.root / "w1"))
    assert human.returncode == 0, human.stderr
    rec.human = human.stdout
    rec.trainer_timeline = trainer.status()["snapshot"]["timeline"]


def _kill_and_restart(run: Any, rec: Run, trainer: Any, v_addr: str) -> Any:
    """Section 2: SIGKILL between checkpoints, restart as it was, wait for the next checkpoint."""
    tmp = rec.root
    tdir = tmp / "trainer" / "trainer"
    wait_for(lambda: kill_window(tmp, K), timeout=400, interval=0.25,
             what="a version announced past the checkpoint")
    trainer.signal(signal.SIGKILL)
    trainer.wait(30)
    rec.ckpt1, rec.announced1 = checkpoint_version(tmp), max(announcements(tmp))
    rec.n_before1 = len(_metrics(tmp))
    rec.recorded1 = max(m["version"] for m in _trained(tmp))
    before = _admitted(tmp)
    # Restart on the same data dir; the old address is gone, so bootstrap through the validator.
    trainer2 = run.start("trainer", "trainer", bootstrap=[v_addr])
    trainer2.wait_ready(180)
    rec.resumed = trainer2.status()["trainer"]
    rec.resumed_log = trainer2.log_path.read_text(errors="replace")
    wait_for(lambda: checkpoint_version(tmp) > rec.announced1, timeout=300,
             what="a checkpoint after the restart")
    consumed = read_state(latest_dir(tdir / "checkpoints")).consumed  # type: ignore[arg-type]  # set by now
    queued = {p.stem for p in (tdir / "inbox").glob("*.json")}
    rec.lost = before - consumed - queued
    return trainer2


def _banned(rec: Run, validator: Any, cheat: Any) -> None:
    """Section 3: the cheater banned. Its status is read once it has submitted more batches than the ban
    took, and it is stopped there: its later batches would only take the honest nodes' CPU. The
    validator's record of its verdicts is read at the end of the run, so a verdict given after this
    still shows."""
    wait_for(lambda: validator.status()["validator"]["banned"] >= 1, timeout=400, interval=0.5,
             what="the cheater banned")
    wait_for(lambda: cheat.status()["worker"]["batches"] > RL["ban_after"], timeout=300, interval=0.5,
             what="a batch from the cheater past the ban's")
    rec.cstat = cheat.status()["worker"]
    cheat.close()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("e2e")
    with role_run(tmp, ("trainer", "validator", "w2", "cheat"), rl=RL) as run:
        rec = Run(tmp, run.ids)
        # Every node launched at once (their start-ups overlap), then each waited for.
        trainer, t_addr, validator, v_addr = run.trainer_and_validator_at_once()
        (tmp / "w1").mkdir()  # a fresh worker: no key yet, join makes one
        rec.launched = time.time() - 0.02  # the kernel counts starts in 10 ms ticks
        w1 = run.start("w1", "worker", bootstrap=[t_addr, v_addr])
        w2 = run.start("w2", "worker", bootstrap=[t_addr, v_addr])
        cheat = run.cheat("cheat", "mix", bootstrap=[t_addr, v_addr])
        run.wait_ready()

        trainer = _kill_and_restart(run, rec, trainer, v_addr)
        _banned(rec, validator, cheat)

        wait_for(lambda: len(_trained(tmp)) >= TOTAL, timeout=900, interval=0.5,
                 what=f"{TOTAL} trained steps")
        _timeline(rec, w1, trainer)
        rec.vstat = validator.status()["validator"]
        rec.w_stats = [w.status()["worker"] for w in (w1, w2)]

    rec.metrics = _metrics(tmp)
    rec.weights = latest_weights_path(tmp / "trainer" / "trainer" / "checkpoints")
    return rec


def test_the_swarm_learns_on_accepted_work_within_the_staleness_bound(swarm: Run) -> None:
    trained = [m for m in swarm.metrics if m["trained"]]
    assert len(trained) >= TOTAL
    assert all(0.0 <= m["pass_rate"] <= 1.0 and m["samples"] == 64 for m in trained)
    assert all(m["staleness_max"] <= 2 for m in trained)  # async_level 2
    # It learned: the final policy against the starting one, same problems, same sampler keys.
    base = load_model(None)
    assert swarm.weights is not None
    before, final = pass_rate(base), pass_rate(with_weights(base, swarm.weights))
    print(f"held-out pass rate {before:.3f} -> {final:.3f} after {len(trained)} steps")
    assert final >= before + RISE, (before, final)


def test_honest_work_is_never_rejected_and_the_cheater_is_rejected_then_banned(swarm: Run) -> None:
    vstat, ids = swarm.vstat, swarm.ids
    assert set(vstat["rejections_by_worker"]) == {ids["cheat"]}, vstat
    assert all(s["rejected"] == 0 and s["accepted"] > 0 for s in swarm.w_stats), swarm.w_stats
    reasons = vstat["reasons_by_worker"][ids["cheat"]]
    # Its batches cheat in turn (reward, tokens, model); one may go stale unjudged (not held against it),
    # so the counted ones are a run of that cycle with gaps: both kinds of check caught it.
    proofs = {"toploc", "logprob", "sampling"}
    assert len(reasons) == RL["ban_after"] and set(reasons) <= proofs | {"reward"}, reasons
    assert "reward" in reasons and proofs & set(reasons), reasons
    assert vstat["banned"] == 1
    # Banned: its later batches drew no verdicts (dropped at the gossip validator), the run went on.
    cstat = swarm.cstat
    assert cstat["batches"] > RL["ban_after"] and cstat["rejected"] <= RL["ban_after"], cstat


def test_a_trainer_killed_between_checkpoints_replays_to_identical_weights(swarm: Run) -> None:
    assert swarm.ckpt1 < swarm.announced1  # the kill landed between checkpoints
    st = swarm.resumed
    # From the checkpoint, then the journal replayed up to at least the last version announced and recorded.
    assert f"resumed at policy v{swarm.ckpt1} " in swarm.resumed_log
    assert st["replay"]["outcome"] == "identical", st["replay"]
    assert st["version"] >= max(swarm.announced1, swarm.recorded1)
    assert not swarm.lost, "accepted batches lost across the kill"

    # Same version numbering across the kill, no version twice, no batch trained twice.
    trained = [m for m in swarm.metrics if m["trained"]]
    versions = [m["version"] for m in trained]
    assert versions == sorted(set(versions)), versions
    after = [m for m in swarm.metrics[swarm.n_before1:] if m["trained"]]
    assert after and after[0]["version"] == swarm.recorded1 + 1
    seen: set[str] = set()
    for m in swarm.metrics:
        assert not seen & set(m["batches"]), "a batch was trained twice"
        seen |= set(m["batches"])


def test_a_fresh_worker_reports_its_join_in_status(swarm: Run) -> None:
    tl = swarm.timeline
    marks = [tl[s] for s in TIMELINE_STAGES]
    assert all(isinstance(m, float) and m >= 0 for m in marks), tl
    # a worker submits only what it generated with a policy, and a verdict follows a submission (the
    # roles start before the node reads "running", so ready may come after the policy)
    assert tl["first_policy"] <= tl["first_batch_submitted"] <= tl["first_batch_accepted"]
    assert tl["process_started_at"] >= swarm.launched  # the worker's own process, not an older one
    assert swarm.cli_timeline["first_batch_accepted"] == tl["first_batch_accepted"]
    line = next(x for x in swarm.human.splitlines() if x.startswith("timeline"))
    assert f"accepted {tl['first_batch_accepted']:.1f} s" in line and "policy" in line, swarm.human
    # the trainer holds its own policy and has peers, but submits nothing
    ttl = swarm.trainer_timeline
    assert ttl["first_policy"] is not None and ttl["first_batch_submitted"] is None
