"""The trainer's metrics mirrors (``roles/trainer/mirrors.py``), on real files: TensorBoard event files read
back with TensorBoard's own reader, an offline W&B run read back from its ``.wandb`` file, a sink that
fails turned off while the other goes on, and a real trainer in one process (``testing/roles.py``) whose
trained steps land in its TensorBoard folder."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from intellect_node.config import build_config
from intellect_node.config.schema import LoggingConfig
from intellect_node.fsutil import read_jsonl
from intellect_node.roles.trainer.metrics import METRICS_FILE
from intellect_node.roles.trainer.mirrors import (
    MAX_QUEUED,
    Mirrors,
    TensorBoardMirror,
    mirror_openers,
    numeric_fields,
)
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.wait import wait_for, wait_until
from tests.support.wandb_run import OfflineRun, read_offline_run


def _line(step: int) -> dict[str, Any]:
    """A metrics line as ``Trainer._record`` writes it (its kinds of values, fewer keys)."""
    return {"step": step, "version": step, "trained": True, "time": 1.8e9 + step, "seq": step + 10,
            "pass_rate": step / 10, "loss": 1.0 / step, "no_signal": "", "loss_kind": "grpo",
            "batch_ages": [0, 1], "batches": ["bafy1", "bafy2"], "groups": 2 * step,
            "hops": {"bafy1": {"worker": "12D3KooW", "notice": 1.8e9}},
            "published": {"version": step - 1, "time": 1.8e9, "publish_s": 0.25},
            "train_s": 0.5, "taken_t": 1.8e9, "trained_t": 1.8e9}


def scalars(directory: Path) -> dict[str, list[tuple[int, Any]]]:
    """Every scalar of the event files in ``directory``, by tag: (step, value) in order (a value is a float;
    tensorboard's reader is untyped, and the tests compare values with ``pytest.approx``)."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_the_numbers_of_a_line_are_mirrored_flattened_and_the_rest_left_out() -> None:
    assert numeric_fields(_line(2)) == {
        "version": 2.0, "trained": 1.0, "pass_rate": 0.2, "loss": 0.5, "groups": 4.0,
        "published/version": 1.0, "published/publish_s": 0.25, "train_s": 0.5}


def test_tensorboard_gets_each_step_and_heldout_result(tmp_path: Path) -> None:
    mirrors = Mirrors([("tensorboard", lambda: TensorBoardMirror(tmp_path / "tb"))])
    mirrors.start()
    for step in (1, 2, 3):
        mirrors.step(_line(step))
    mirrors.step({**_line(3), "trained": False, "loss": 0.0})  # an attempt that trained nothing
    mirrors.log_heldout(2, {"version": 2, "pass_rate": 0.4, "mean_reward": 0.45, "n": 512,
                            "evaluator": "12D3KooW"})
    mirrors.close()

    got = scalars(tmp_path / "tb")
    assert got["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert got["train/pass_rate"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                      (3, pytest.approx(0.3))]
    assert got["train/published/publish_s"] == [(s, 0.25) for s in (1, 2, 3)]
    assert got["heldout/pass_rate"] == [(2, pytest.approx(0.4))] and got["heldout/n"] == [(2, 512.0)]
    assert not [t for t in got if t.startswith("train/hops") or t in ("train/step", "train/time",
                                                                       "heldout/version")]
    assert mirrors.status() == {"sinks": ["tensorboard"], "failed": {}, "written": 4, "dropped": 0}


def test_an_offline_wandb_run_holds_the_history_summary_and_settings(tmp_path: Path) -> None:
    cfg = build_config({"run": {"run_id": "mirror-test"}, "logging": {"wandb": True,
                                                                     "wandb_dir": str(tmp_path / "wb")}})
    mirrors = Mirrors(mirror_openers(cfg, tmp_path / "trainer"))
    mirrors.start()
    for step in (1, 2, 3):
        mirrors.step(_line(step))
    mirrors.log_heldout(3, {"pass_rate": 0.4})
    mirrors.close()

    [run_dir] = (tmp_path / "wb" / "wandb").glob("offline-run-*")  # offline: written here, nothing sent
    [run_file] = run_dir.glob("run-*.wandb")
    # wandb-core writes the file out when the run's stream closes, just after finish() returned
    run = wait_for(lambda: (r := read_offline_run(run_file)).exited and r, what="the run's exit record")
    assert isinstance(run, OfflineRun)
    assert run.name == "mirror-test"
    assert run.config["run"]["run_id"] == "mirror-test" and run.config["rl"]["lr"] == cfg.rl.lr
    rows = {r["_step"]: r for r in run.history}
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["train/loss"] for s in (1, 2, 3)] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert rows[3]["heldout/version"] == 3 and rows[3]["heldout/pass_rate"] == 0.4
    assert run.summary["train/loss"] == pytest.approx(1 / 3) and run.summary["train/groups"] == 6
    assert mirrors.status()["failed"] == {}


class _Recording:
    """A sink that keeps what it is given, and raises from the step ``fail_at`` on."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.steps: list[int] = []
        self.closed = False

    def train(self, step: int, fields: Mapping[str, float]) -> None:
        if self.fail_at is not None and step >= self.fail_at:
            raise OSError("disk full")
        self.steps.append(step)

    def heldout(self, version: int, fields: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _broken() -> TensorBoardMirror:
    raise ImportError("no module named tensorboard")


def test_a_failing_sink_is_turned_off_with_one_warning_and_the_others_go_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failing, healthy = _Recording(fail_at=2), _Recording()
    mirrors = Mirrors([("tensorboard", _broken), ("recording", lambda: failing),
                       ("healthy", lambda: healthy)])
    mirrors.start()
    with caplog.at_level(logging.WARNING, logger="intellect_node.roles.trainer.mirrors"):
        for step in range(1, 6):
            mirrors.step(_line(step))
        mirrors.close()

    assert failing.steps == [1] and not failing.closed  # off after its first error: not called again
    assert healthy.steps == [1, 2, 3, 4, 5] and healthy.closed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per failed sink
    assert "tensorboard metrics mirror (logging.tensorboard) failed" in warnings[0]
    assert "no module named tensorboard" in warnings[0]
    assert "recording metrics mirror" in warnings[1] and "OSError: disk full" in warnings[1]
    status = mirrors.status()
    assert status["sinks"] == ["healthy"] and status["written"] == 5
    assert status["failed"] == {"tensorboard": "ImportError: no module named tensorboard",
                                "recording": "OSError: disk full"}


def test_lines_past_the_queue_bound_are_dropped_while_a_sink_is_stuck(
        caplog: pytest.LogCaptureFixture) -> None:
    release, sink = threading.Event(), _Recording()

    def stuck() -> _Recording:  # the thread waits here, as in a wandb.init that hangs
        release.wait()
        return sink

    mirrors = Mirrors([("stuck", stuck)])
    mirrors.start()
    with caplog.at_level(logging.WARNING, logger="intellect_node.roles.trainer.mirrors"):
        for step in range(1, MAX_QUEUED + 6):
            mirrors.step({"step": step, "trained": True, "loss": 1.0})
        release.set()
        mirrors.close()
    assert sink.steps == list(range(1, MAX_QUEUED + 1)) and sink.closed
    assert mirrors.status()["dropped"] == 5
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{MAX_QUEUED} metrics lines wait for the mirrors (stuck)" in warning


def test_without_a_sink_nothing_starts_and_lines_are_ignored(tmp_path: Path) -> None:
    mirrors = Mirrors(mirror_openers(build_config({}), tmp_path))
    mirrors.start()
    mirrors.step(_line(1))
    mirrors.close()
    assert mirrors.status() == {"sinks": [], "failed": {}, "written": 0, "dropped": 0}
    assert list(tmp_path.iterdir()) == []


def test_default_folders_are_under_the_trainer_dir(tmp_path: Path) -> None:
    cfg = build_config({"logging": {"tensorboard": True}})
    [(name, open_sink)] = mirror_openers(cfg, tmp_path / "trainer")
    sink = open_sink()
    sink.close()
    assert name == "tensorboard" and isinstance(sink, TensorBoardMirror)
    assert list((tmp_path / "trainer" / "tensorboard").glob("events.out.tfevents.*"))


RL = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
          work_ahead=1)


def test_a_trainer_with_tensorboard_on_writes_its_trained_steps(tmp_path: Path) -> None:
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL)
    logged = cfg.model_copy(update={"logging": LoggingConfig(tensorboard=True)})
    trainer_dir = tmp_path / "trainer" / "trainer"

    def trained() -> int:
        path = trainer_dir / METRICS_FILE
        return sum(1 for m in read_jsonl(path) if m.get("trained")) if path.exists() else 0

    async def main() -> dict[str, object]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", logged, Trainer.for_runtime)
            await net.start("validator", cfg, Validator.for_runtime)
            await net.start("w", cfg, Worker.for_runtime)
            await wait_until(lambda: trained() >= 2, timeout=300, what="2 trained steps")
            assert not net.failures(), net.failures()
            status: dict[str, object] = trainer.status()["mirrors"]
            return status  # the context's end stops the trainer, which closes its mirrors

    status = asyncio.run(main())
    lines = [m for m in read_jsonl(trainer_dir / METRICS_FILE) if m["trained"]]
    got = scalars(trainer_dir / "tensorboard")
    assert got["train/loss"] == [(m["step"], pytest.approx(m["loss"])) for m in lines]
    assert got["train/reward_mean"] == [(m["step"], pytest.approx(m["reward_mean"])) for m in lines]
    assert status["sinks"] == ["tensorboard"] and status["failed"] == {}
    assert not (tmp_path / "validator" / "trainer" / "tensorboard").exists()  # the others have it off
