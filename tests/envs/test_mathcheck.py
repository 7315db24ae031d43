"""The ``math`` checker (math-verify in a scoring process): equal values in different notations match,
different values do not, and the checker is reachable from task files and environment settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from intellect_node.envs.environment import build_task
from intellect_node.envs.jsonl_tasks import load_jsonl_tasks
from intellect_node.envs.tasks import Problem


def math_problem(answer: str) -> Problem:
    return Problem("m", "m/0", "?", answer, checker="math")


@pytest.mark.parametrize("answer,completion", [
    ("1/2", "0.5"),
    ("0.5", "\\frac12"),
    ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$."),
    ("$\\frac{1}{2}$", "1/2"),
    ("\\sqrt{2}", "2^{1/2}"),
    ("x^2+1", "1+x^2"),
    ("\\{1,2\\}", "\\{2, 1\\}"),
    ("50\\%", "0.5"),
    ("5", "After some work, the answer is 5."),
    ("12", "\\boxed{12}"),
])
def test_equal_values_in_other_notations_score_1(answer: str, completion: str) -> None:
    assert math_problem(answer).judge(completion).reward == 1.0


@pytest.mark.parametrize("answer,completion", [
    ("1/3", "0.333"),
    ("1/2", "\\frac{1}{3}"),
    ("\\pi", "3.14159"),
    ("5", ""),
    ("5", "no number here"),
])
def test_different_values_score_0(answer: str, completion: str) -> None:
    assert math_problem(answer).judge(completion).reward == 0.0


def test_unparseable_reference_is_a_reason_not_a_crash() -> None:
    judged = math_problem("").judge("5")
    assert (judged.reward, judged.reason) == (0.0, "checker_error")


def test_task_file_with_the_math_checker(tmp_path: Path) -> None:
    f = tmp_path / "algebra.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "Half of one?", "answer": "\\frac{1}{2}", "checker": "math"},
        {"prompt": "Two plus two?", "answer": 4, "checker": "math"},
    ]) + "\n")
    task = load_jsonl_tasks(f, register=False)
    assert task.problem(0).reward("0.5") == 1.0 and task.problem(1).reward("4.0") == 1.0
    assert task.problem(1).reward("5") == 0.0


def test_boxed_extraction_then_math(tmp_path: Path) -> None:
    """With answer_format = "boxed" the checker sees only the box: a right number elsewhere in the text
    does not count, and the task ID carries the settings."""
    f = tmp_path / "boxes.jsonl"
    f.write_text(json.dumps({"prompt": "1/4 as a decimal?", "answer": "1/4", "checker": "math"}) + "\n")
    task = build_task(tasks_file=str(f), answer_format="boxed", think="strip")
    assert task.task_id.startswith("boxes@")
    p = task.problem(0)
    assert p.judge("<think>maybe 0.25</think> so \\boxed{0.25}").reward == 1.0
    assert p.judge("0.25").reason == "no_answer"
    assert p.judge("<think>0.25 is \\boxed{0.25}").reason == "unclosed_think"


def test_answers_are_not_run_as_code(tmp_path: Path) -> None:
    """math-verify hands regex-matched arithmetic to sympy's parse_expr (Python eval): answers that
    would touch a file if evaluated, bare or in LaTeX, touch nothing."""
    marker = tmp_path / "pwned"
    p = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    for text in [p, f"[{p}]", f"${p}$", f"\\boxed{{{p}}}", f"x = {p}", f"{p} + 1", f"\\text{{{p}}}"]:
        assert math_problem("5").reward(text) == 0.0
        assert math_problem(text).judge("5").reward == 0.0
    assert not marker.exists()
