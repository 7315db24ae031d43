"""`intellect-node demo`: a real local swarm (trainer, validator, workers as processes). Headless, it runs N
trainer steps and writes the report, every child exits 0, and a trainer port taken before the trainer binds
it makes the demo start again on another; Ctrl-C keeps the logs and says where. The report, warnings and
plan of a demo that cannot learn come from the roles run in one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import invoke_cli


@pytest.mark.slow
@pytest.mark.timeout(480)  # four node processes start (torch + libp2p imports) on a shared 2-core machine
def test_headless_demo_runs_steps_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --headless --steps 2 --report FILE`` (the command in this process, its nodes real processes).

    Every node starts at once, bootstrapped to a trainer port picked just before; here another process
    listens there first. The trainer exits 2 naming the port, and the demo starts everything again on
    another port instead of failing or leaving the others dialling nobody: the run then reaches its steps
    as any other."""
    import socket

    from intellect_node.commands import demo
    from intellect_node.p2p.ports import free_tcp_port

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(demo, "free_tcp_port", lambda: next(picks, None) or free_tcp_port())
    report = tmp_path / "report.json"
    root = tmp_path / "swarm"
    try:
        r = invoke_cli("demo", "--headless", "--steps", "2", "--report", str(report), "--dir", str(root),
                       "--timeout", "360")
    finally:
        squatter.close()
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads(report.read_text())
    assert [s["step"] for s in doc["steps"]] == sorted({s["step"] for s in doc["steps"]})
    assert len(doc["steps"]) == 2
    for s in doc["steps"]:
        assert 0.0 <= s["pass_rate"] <= 1.0 and isinstance(s["reward_mean"], float)
    assert doc["rollouts"]["accepted"] > 0 and doc["rollouts"]["rejected"] >= 0
    assert doc["stopped_because"] == "steps reached"
    # held-out evaluation is on in the demo: the validator's signed result of policy v0 at least
    held = doc["held_out"]
    assert held["n"] == 128 and held["version"] % 5 == 0 and 0.0 <= held["pass_rate"] <= 1.0
    assert held["evaluator"] in {n["peer_id"] for n in doc["nodes"] if n["role"] == "validator"}
    assert set(doc["exit_codes"]) == {"trainer", "validator0", "worker0", "worker1"}
    assert all(code == 0 for code in doc["exit_codes"].values()), doc["exit_codes"]

    # The port retry: two starts, the second on another port, where the trainer listened. That the others
    # reached the trainer at its new address is the steps above: the workers fetched the run from it, and
    # it trained only on what the validator's verdicts accepted.
    assert f"port {taken} was taken" in r.stderr, r.stderr[-3000:]
    starts = [line for line in r.stderr.splitlines() if line.startswith("starting the trainer")]
    assert len(starts) == 2 and f"127.0.0.1:{taken} " in starts[0], starts
    port = int(starts[1].split("127.0.0.1:", 1)[1].split()[0])
    assert port != taken
    records = [json.loads(line) for line in (root / "trainer" / "node.log").read_text().splitlines()]
    (up,) = [rec["msg"] for rec in records if " up: " in rec["msg"]]
    assert f"--bootstrap /ip4/127.0.0.1/tcp/{port}/p2p/" in up and f"/tcp/{taken}/" not in up, up

    # each worker's ledger recorded what it submitted, and it was flushed on SIGTERM. The workers join by
    # the run's CID (manifest and model fetched from the trainer first), so one may come up a few seconds
    # after the other under load, when the first has already fed both steps (work_ahead): together they
    # submitted the steps' batches, each ledger is closed cleanly whatever it holds.
    submitted = 0
    for w in ("worker0", "worker1"):
        assert not (root / w / "ledger.sqlite-wal").exists()  # checked before a reader opens it
        led = invoke_cli("ledger", "--data-dir", str(root / w), "--json")
        assert led.returncode == 0, led.stderr[-2000:]
        submitted += json.loads(led.stdout)["summary"]["batches_submitted"]
    assert submitted >= 2


def test_step_log_keeps_steps_across_polls_and_counts_validator_verdicts() -> None:
    from intellect_node.commands.demo import StepLog, rollout_counts
    from intellect_node.config.status import StatusBoard

    trainer, validator, worker = (StatusBoard(role="trainer"), StatusBoard(role="validator"),
                                  StatusBoard(role="worker"))
    log = StepLog()
    for step in range(5):
        trainer.train_step(step, reward_mean=step / 10, pass_rate=step / 5)
        if step % 2:
            log.update([trainer.snapshot()])
    log.update([trainer.snapshot()])
    assert [s["step"] for s in log.ordered()] == [0, 1, 2, 3, 4]
    assert log.ordered()[3] == {"step": 3, "pass_rate": 0.6, "reward_mean": 0.3}
    validator.verdict(True, 64)
    validator.verdict(False, 64, reason="toploc")
    worker.rollouts_generated(128)
    worker.verdict(True, 64)
    snaps = [trainer.snapshot(), validator.snapshot(), worker.snapshot()]
    assert rollout_counts(snaps) == {"accepted": 64, "rejected": 64, "generated": 128}
    # without validators the workers' own counts are used
    assert rollout_counts([trainer.snapshot(), worker.snapshot()])["accepted"] == 64


def test_step_log_keeps_the_trainers_learning_diagnosis() -> None:
    from intellect_node.commands.demo import StepLog
    from intellect_node.config.status import StatusBoard

    trainer = StatusBoard(role="trainer")
    log = StepLog()
    for _ in range(3):
        trainer.train_attempt(groups=8, filtered=8, cause="all_zero", hint="every reward 0")
    log.update([trainer.snapshot()])
    assert log.learning["no_signal_attempts"] == 3 and log.learning["no_signal_causes"] == {"all_zero": 3}
    assert "every reward 0" in log.learning["warning"] == log.learning["last_warning"]
    trainer.train_step(1, reward_mean=0.5, pass_rate=0.5)
    trainer.train_attempt(groups=8, filtered=2)
    log.update([trainer.snapshot()])
    assert log.learning["warning"] == "" and "every reward 0" in log.learning["last_warning"]


def test_a_demo_that_cannot_learn_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's own plan (``--config``, one worker) run by the roles in one process
    (``intellect_node.testing.roles``), and the headless demo's report and warnings made from their status
    snapshots by :func:`~intellect_node.commands.demo.run_headless` itself. That the demo's processes run
    and stop is the headless test's."""
    import asyncio
    from types import SimpleNamespace

    from intellect_node.commands.demo import plan_demo, run_headless
    from intellect_node.config.status import StatusSnapshot
    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.roles.validator.role import Validator
    from intellect_node.roles.worker.role import Worker
    from intellect_node.testing.roles import in_process_swarm, key_of, run_config
    from tests.support.wait import wait_until

    # The embedded model never writes answer tags: every reward 0, every group filtered out.
    conf = tmp_path / "tags.toml"
    conf.write_text('[rl]\nanswer_format = "answer_tags"\n')
    plan = plan_demo(model=None, env=None, env_args={}, config_file=conf, workers=1)
    assert plan.extra["rl"]["answer_format"] == "answer_tags" and plan.workers == 1
    names = {"trainer": "trainer", "validator0": "validator", "worker0": "worker"}
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator0").peer_id],
                     rl=plan.extra["rl"], run_id="demo-tags")

    async def main() -> list[StatusSnapshot]:
        async with in_process_swarm(tmp_path / "swarm") as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime, label="trainer")
            await net.start("validator0", cfg, Validator.for_runtime, label="validator")
            await net.start("worker0", cfg, Worker.for_runtime, label="worker")
            await wait_until(lambda: trainer.board.snapshot().training.no_signal_warning, timeout=300,
                             what="a streak of step attempts with no learnable group")
            assert not net.failures(), net.failures()
            return [n.board.snapshot() for n in net.nodes.values()]

    snaps = asyncio.run(main())

    class Ended:
        """What ``run_headless`` reads of a ``DemoSwarm``: these snapshots, every node up, then stopped."""

        run_id = "demo-tags"
        nodes = [SimpleNamespace(name=n, role=r, peer_id=key_of(n).peer_id) for n, r in names.items()]

        def dead(self) -> list[Any]:
            return []

        def snapshots(self) -> list[StatusSnapshot]:
            return snaps

        def stop(self) -> dict[str, int]:
            return {n: 0 for n in names}

    report = tmp_path / "report.json"
    capsys.readouterr()
    # One poll of the swarm, then the demo's timeout: no step comes.
    code = run_headless(Ended(), steps=1, timeout=0.1, report=report)  # type: ignore[arg-type]  # a stand-in for it
    err = capsys.readouterr().err
    assert code == 1, err[-4000:]
    doc = json.loads(report.read_text())
    assert doc["steps"] == [] and doc["learning"]["no_signal_attempts"] >= 1
    assert doc["learning"]["no_signal_causes"].get("all_zero", 0) >= 1
    assert "NOT LEARNING" in err and "every reward 0" in err
    assert "the run was not learning" in err


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_ctrl_c_keeps_the_logs_and_says_where(tmp_path: Path) -> None:
    """Ctrl-C on a demo in its default temporary dir: every node stops, the temporary dir goes, and each
    node's log is kept (0600, in a 0700 dir under the user log dir) at the path the demo prints. The run's
    held-out evaluation is turned off with ``--config`` (``run.eval_every = 0``), as an operator would,
    and the kept config says so."""
    import os
    import signal
    import stat
    import subprocess
    import tomllib

    from tests.support.common import CLI
    from tests.support.wait import wait_for

    tmp, state = tmp_path / "tmp", tmp_path / "state"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "XDG_STATE_HOME": str(state)}
    conf = tmp_path / "no-eval.toml"
    conf.write_text("[run]\neval_every = 0\n")
    with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
        # not a terminal and not --headless: the plain dashboard lines until Ctrl-C
        demo = subprocess.Popen([CLI, "demo", "--workers", "1", "--run-id", "demo-ctrlc", "--config",
                                 str(conf)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        try:
            def all_up() -> bool:
                assert demo.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
                dirs = list(tmp.glob("intellect-demo-*/*/control.json"))
                return len(dirs) == 3
            wait_for(all_up, timeout=360, interval=0.5, what="trainer, validator and worker up")
            demo.send_signal(signal.SIGINT)
            assert demo.wait(120) == 0, (tmp_path / "stderr").read_text()[-3000:]
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait(10)
    text = (tmp_path / "stderr").read_text()
    kept = state / "intellect-node" / "log" / "demo" / "demo-ctrlc"
    assert f"logs kept in {kept}" in text, text[-3000:]
    assert not list(tmp.glob("intellect-demo-*")), "the temporary dir is removed"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o700
    names = {p.name for p in kept.iterdir()}
    assert {"trainer.log", "validator0.log", "worker0.log", "demo.toml"} <= names, names
    for name in names - {"demo.toml"}:
        assert stat.S_IMODE((kept / name).stat().st_mode) == 0o600, name
    assert tomllib.loads((kept / "demo.toml").read_text())["run"]["eval_every"] == 0
    trainer_log = (kept / "trainer.log").read_text()
    assert '"stopping"' in trainer_log or "stopped in" in trainer_log  # the log runs to the clean stop


def test_demo_workers_together_make_at_least_a_step_each_version() -> None:
    """One batch per worker per version (``work_ahead`` runs them ahead): however many workers the demo
    starts, their batches of one version hold at least the groups one step takes, so the trainer never
    waits on a worker's resubmission timer."""
    from intellect_node.commands.demo import DEMO_RL, demo_rl

    for workers in range(1, 9):
        rl = demo_rl(workers)
        assert rl["batches_per_version"] == 1 and rl["work_ahead"] >= 1
        made = workers * rl["problems_per_batch"]
        assert rl["groups_per_step"] <= made < rl["groups_per_step"] + workers, (workers, rl)
    assert demo_rl(2) == DEMO_RL
