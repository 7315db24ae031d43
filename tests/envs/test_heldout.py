"""The run's held-out problems (``envs/heldout.py``): disjoint from training by construction for every task
source, the same on every node, never assigned to a worker, refused as training work; and the settings'
errors name the field."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from intellect_node.config import build_config
from intellect_node.envs.assignment import Assignments
from intellect_node.envs.environment import build_task
from intellect_node.envs.filtering import filter_by_rates_file, save_solve_rates
from intellect_node.envs.heldout import Split
from intellect_node.envs.tasks import AdditionTask, Task, embedded_task
from intellect_node.errors import ConfigError
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.roles.common.tasks import held_out_task, run_assignments, run_task, wrong_task
from intellect_node.testing.roles import key_of

RUN = "heldout"


def _tasks_file(tmp: Path, n: int) -> str:
    path = tmp / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "checker": "integer"})
                            + "\n" for i in range(n)))
    return str(path)


def _sources(tmp: Path) -> dict[str, Task]:
    """A small task of each source ``[rl]`` can name (small enough to enumerate both parts)."""
    rates = tmp / "rates.json"
    save_solve_rates(rates, {f"add3/{i}": (i % 10) / 10 for i in range(0, 2000, 7)})
    return {"addition": AdditionTask(1),
            "jsonl": build_task(tasks_file=_tasks_file(tmp, 90)),
            "reasoning_gym": build_task(env="reasoning_gym:basic_arithmetic",
                                        env_args={"seed": 1, "size": 120}),
            "filtered": filter_by_rates_file(embedded_task(), rates, (0.2, 0.8))}


def test_the_parts_are_disjoint_cover_the_task_and_refuse_each_others_problems(tmp_path: Path) -> None:
    for name, task in _sources(tmp_path).items():
        split = Split(task, RUN, 20)
        held = [split.held_out.problem(j).problem_id for j in range(len(split.held_out))]
        train = [split.training.problem(k).problem_id for k in range(len(split.training))]
        everything = [task.problem(i).problem_id for i in range(len(task))]
        assert len(held) == 20 and len(set(held)) == 20, name
        assert not set(held) & set(train), name
        assert sorted(held + train) == sorted(everything), name
        for k, pid in enumerate(train[:30]):
            assert split.training.index_of(pid) == k and split.training.get(pid).problem_id == pid
            with pytest.raises(ConfigError, match="training problem"):
                split.held_out.get(pid)
        for j, pid in enumerate(held):
            assert split.held_out.index_of(pid) == j and split.held_out.get(pid) == task.get(pid)
            with pytest.raises(ConfigError, match="held out of training"):
                split.training.get(pid)
        # the same rule on another node; another run holds out other problems
        again = Split(task, RUN, 20)
        assert [again.held_out.problem(j).problem_id for j in range(20)] == held, name
        other = Split(task, "another-run", 20)
        assert [other.held_out.problem(j).problem_id for j in range(20)] != held, name


def test_a_larger_held_out_part_keeps_the_smaller_ones_problems() -> None:
    task = AdditionTask(2)
    small, large = Split(task, RUN, 10), Split(task, RUN, 50)
    assert [small.held_out.problem(j) for j in range(10)] == [large.held_out.problem(j) for j in range(10)]


def _cfg(**run: Any) -> Any:
    return build_config({"run": {"run_id": RUN, **run},
                         "rl": {"task": "add3", "problems_per_batch": 4, "group_size": 2}})


def test_with_evaluation_on_no_worker_is_assigned_a_held_out_problem() -> None:
    cfg = _cfg(eval_every=2, eval_problems=512, async_level=1)
    held = {held_out_task(cfg).problem(j).problem_id for j in range(512)}
    assert len(held) == 512
    task = run_task(cfg)
    assert len(task) == 1_000_000 - 512
    assignments: Assignments = run_assignments(cfg, task)
    for w in range(8):
        worker = key_of(f"worker-{w}").peer_id
        for v in range(4):
            for k in (0, 1, 2, 500, assignments.layout.windows - 1):
                ids = [p.problem_id for p in assignments.problems(worker, v, k)]
                assert not set(ids) & held
    # a batch naming a held-out problem is not the worker's assignment, and not work on the run's task
    worker = key_of("worker-0").peer_id
    ids = [p.problem_id for p in assignments.problems(worker, 0, 0)]
    forged = [next(iter(held))] + ids[1:]
    assert isinstance(assignments.check(worker, 0, [p for p in forged for _ in range(2)], 2), str)


def test_the_task_check_refuses_a_rollout_of_a_held_out_problem() -> None:
    cfg = _cfg(eval_every=1, eval_problems=8)
    pid = held_out_task(cfg).problem(3).problem_id
    rec = cast(RolloutRecord, SimpleNamespace(task_id="add3", problem_id=pid))  # what wrong_task reads
    assert wrong_task(run_task(cfg), [rec]) == f"{pid!r} is not a problem of the run's task 'add3'"
    assert wrong_task(run_task(_cfg()), [rec]) == ""  # evaluation off: every problem is a training one


def test_evaluation_off_leaves_the_task_whole() -> None:
    cfg = _cfg()
    assert len(run_task(cfg)) == 1_000_000
    with pytest.raises(ConfigError, match="run.eval_every is 0") as err:
        held_out_task(cfg)
    assert err.value.field == "run.eval_every"


def test_bad_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run.eval_problems") as err:
        _cfg(eval_every=1, eval_problems=513)
    assert err.value.field == "run.eval_problems"
    with pytest.raises(ConfigError, match="run.eval_every") as err:
        _cfg(eval_every=-1)
    assert err.value.field == "run.eval_every"
    # A node's own validator.evaluate meets a run that holds nothing out (its settings come from the
    # manifest when joined by CID): accepted, and the validator does not evaluate.
    off = build_config({"run": {"run_id": RUN}, "validator": {"evaluate": True}})
    from intellect_node.config.status import StatusBoard
    from intellect_node.roles.validator.evals import Evaluations

    assert not Evaluations(off, None, StatusBoard(role="validator"), tmp_path,  # type: ignore[arg-type]  # a stand-in for it
                           lambda v: None).evaluate
    with pytest.raises(ConfigError, match="validator.eval_recheck_fraction"):
        build_config({"validator": {"eval_recheck_fraction": 1.5}})
    small = build_config({"run": {"run_id": RUN, "eval_every": 1, "eval_problems": 46},
                          "rl": {"tasks_file": _tasks_file(tmp_path, 90)}})
    with pytest.raises(ConfigError, match="at most half of them \\(45\\)") as err:
        run_task(small)
    assert err.value.field == "run.eval_problems"
