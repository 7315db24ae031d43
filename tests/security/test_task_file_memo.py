"""A plain task file with the ``math`` checker scores through the memo.

A hostile worker can repeat one slow completion across a whole batch; each distinct (problem, answer)
must pay the checker's time limit once per node. Task files under the default settings were used as
they are, so their ``math`` problems called the checker for every rollout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from intellect_node.envs import environment
from intellect_node.envs.environment import SettledTask, build_task


def test_a_math_task_file_keeps_its_id_and_remembers_judgements(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "algebra.jsonl"
    path.write_text(json.dumps({"prompt": "Half of 1?", "answer": "1/2", "checker": "math"}) + "\n")
    calls: list[str] = []

    def check_math(answer: str, reference: str, timeout_s: float = 5.0) -> float:
        calls.append(answer)
        return 1.0 if answer == "0.5" else 0.0

    monkeypatch.setattr("intellect_node.envs.mathcheck.check_math", check_math)
    task = build_task(tasks_file=str(path))
    assert isinstance(task, SettledTask) and task.task_id == "algebra"  # no settings hashed: same ID
    problem = task.get("algebra/0")
    assert problem.problem_id == "algebra/0"
    for _ in range(16):  # one batch repeating one completion
        assert problem.reward("0.5") == 1.0
    assert calls == ["0.5"]


def test_a_task_file_of_cheap_checkers_is_used_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "sums.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "answer": "4", "checker": "integer"}) + "\n")
    task = build_task(tasks_file=str(path))
    assert not isinstance(task, SettledTask) and task.task_id == "sums"
    assert environment.SLOW_CHECKERS == {"math"}
