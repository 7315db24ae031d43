"""reasoning-gym environments: problems rebuilt by ID on every node, scored with the dataset's own
checker; settings that differ between nodes are caught by the task ID; bad settings name the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config import build_config
from intellect_node.envs import reasoning_gym as rg
from intellect_node.envs.environment import build_task
from intellect_node.envs.tasks import Task, resolve_problem
from intellect_node.errors import ConfigError

ENVS: dict[str, dict[str, object]] = {
    "reasoning_gym:chain_sum": {"seed": 11, "size": 1000, "min_terms": 3},
    "reasoning_gym:basic_arithmetic": {"seed": 5, "size": 200},
    "reasoning_gym:leg_counting": {"size": 300},
}
INDEXES = [0, 7, 199]


def completions(answer: str) -> list[str]:
    return [f"<think>let me see</think><answer>{answer}</answer>", answer, f"<answer>{answer}0</answer>",
            f"<answer>the answer is {answer}</answer>", "<think>unfinished <answer>1</answer>", ""]


def node_view(env: str, args: dict[str, object]) -> dict[str, object]:
    """What one node builds and scores for ``env`` (run here and in a second process)."""
    task = build_task(env=env, env_args=args)
    probs = [task.problem(i) for i in INDEXES]
    return {"task_id": task.task_id,
            "problems": [[p.problem_id, p.prompt, p.answer, p.system] for p in probs],
            "rewards": [[p.reward(c) for c in completions(p.answer)] for p in probs]}


SECOND_NODE = """
import json, sys
from tests.envs.test_reasoning_gym import ENVS, node_view
print(json.dumps({env: node_view(env, args) for env, args in ENVS.items()}))
"""


def test_two_nodes_build_and_score_the_same_problems() -> None:
    """A second process with another hash seed stands in for another node: same IDs, prompts, answers,
    system prompt and rewards (several datasets' generators iterate sets, so the hash seed matters)."""
    here: dict[str, dict[str, Any]] = {env: node_view(env, args) for env, args in ENVS.items()}
    out = subprocess.run([sys.executable, "-c", SECOND_NODE], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=os.getcwd()), timeout=240)
    there = json.loads(out.stdout)
    assert there == json.loads(json.dumps(here))
    for view in here.values():
        assert all(r[0] == 1.0 and r[1] == 0.0 and r[4] == 0.0 for r in view["rewards"])


def test_problem_ids_round_trip_and_are_canonical() -> None:
    task = build_task(env="reasoning_gym:chain_sum", env_args={"seed": 3, "size": 50})
    assert isinstance(task, Task) and len(task) == 50
    p = task.problem(17)
    assert p.problem_id == f"{task.task_id}/17" and task.task_id.startswith("reasoning_gym:chain_sum@")
    assert task.get(p.problem_id) == p == resolve_problem(p.problem_id)  # registered: the verifier resolves
    for bad in (f"{task.task_id}/017", f"{task.task_id}/50", f"{task.task_id}/-1", f"{task.task_id}/１",
                f"{task.task_id}/", "reasoning_gym:chain_sum/17"):
        with pytest.raises(ConfigError):
            task.get(bad)


def test_other_settings_do_not_share_problem_ids() -> None:
    """A validator whose settings differ from the worker's cannot resolve the worker's problems (the
    verifier rejects them as unknown_task) instead of scoring them another way."""
    worker = build_task(env="reasoning_gym:chain_sum", env_args={"seed": 1, "size": 100})
    pid = worker.problem(3).problem_id
    same = {"seed": 1, "size": 100}
    variants: list[dict[str, object]] = [
        dict(env_args={"seed": 2, "size": 100}),
        dict(env_args={"seed": 1, "size": 101}),
        dict(env_args={"seed": 1, "size": 100, "max_terms": 5}),
        dict(env_args=same, answer_format="last_line"),
        dict(env_args=same, think="keep"),
        dict(env_args=same, system_prompt="Answer."),
        dict(env_args=same, max_completion_chars=1000),
    ]
    ids = {worker.task_id}
    for kw in variants:
        other = build_task(env="reasoning_gym:chain_sum", **kw)  # type: ignore[arg-type]  # keyword arguments from a table
        assert other.task_id not in ids
        ids.add(other.task_id)
        with pytest.raises(ConfigError):
            other.get(pid)
    # the time limit is local tuning: a slower validator may allow more, and still shares the IDs
    patient = build_task(env="reasoning_gym:chain_sum", env_args=same, reward_timeout_s=30)
    assert patient.task_id == worker.task_id and patient.get(pid) == worker.problem(3)


def test_rewards_are_the_datasets_own_scores() -> None:
    from reasoning_gym import create_dataset

    task = build_task(env="reasoning_gym:leg_counting", env_args={"seed": 4, "size": 20})
    ds = create_dataset("leg_counting", seed=4, size=20)
    for i in range(5):
        entry, p = ds[i], task.problem(i)
        assert p.prompt == entry["question"]
        for answer in (entry["answer"], str(int(entry["answer"]) + 1), "many", f"{entry['answer']} legs"):
            assert p.reward(f"<answer>{answer}</answer>") == ds.score_answer(answer, entry)


def test_a_checker_crash_is_a_reason() -> None:
    """prime_factorization's score_answer raises on a non-numeric answer: reward 0, checker_error."""
    p = build_task(env="reasoning_gym:prime_factorization", env_args={"size": 10}).problem(0)
    judged = p.judge("<answer>zzz</answer>")
    assert (judged.reward, judged.reason) == (0.0, "checker_error")
    assert p.judge(f"<answer>{p.answer}</answer>").reward == 1.0


def test_unknown_and_refused_datasets_are_named_with_the_list() -> None:
    with pytest.raises(ConfigError) as info:
        build_task(env="reasoning_gym:chain_sums")
    assert info.value.field == "rl.env"
    assert "chain_sum" in str(info.value) and "leg_counting" in str(info.value)
    with pytest.raises(ConfigError, match="PYTHONHASHSEED") as info:
        build_task(env="reasoning_gym:word_ladder")
    assert info.value.field == "rl.env"
    with pytest.raises(ConfigError, match="any non-empty answer"):
        build_task(env="reasoning_gym:game_of_life_halting")
    with pytest.raises(ConfigError, match="reasoning_gym:<dataset>") as info:
        build_task(env="verifiers:gsm8k")
    assert info.value.field == "rl.env"
    assert "word_ladder" not in rg.available() and "chain_sum" in rg.available()


@pytest.mark.parametrize("kwargs,field,needle", [
    (dict(env_args={"min_term": 2}), "rl.env_args.min_term", "min_terms"),
    (dict(env_args={"size": "ten"}), "rl.env_args.size", "int"),
    (dict(env_args={"allow_negation": 1}), "rl.env_args.allow_negation", "bool"),
    (dict(env_args={"min_terms": 5, "max_terms": 2}), "rl.env_args", "max_terms"),
    (dict(env_args={"size": 0}), "rl.env_args", "size"),
    (dict(tasks_file="x.jsonl"), "rl.env", "both set"),
    (dict(task="add2"), "rl.task", "drop rl.task"),
    (dict(reward_timeout_s=0), "rl.reward_timeout_s", "reward_timeout_s"),
])
def test_bad_environment_settings_name_the_field(kwargs: dict[str, object], field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_task(env="reasoning_gym:chain_sum", **kwargs)  # type: ignore[arg-type]  # keyword arguments from a table
    assert info.value.field == field and needle in str(info.value), str(info.value)


def test_env_args_without_env_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        build_task(env_args={"seed": 1})
    assert info.value.field == "rl.env_args"


@pytest.mark.parametrize("rl,field", [
    ({"answer_format": "regex"}, "rl.answer_format"),
    ({"think": "sometimes"}, "rl.think"),
    ({"max_completion_chars": 0}, "rl.max_completion_chars"),
    ({"reward_timeout_s": -1}, "rl.reward_timeout_s"),
    ({"env_args": {"seed": {"nested": 1}}}, "rl.env_args.seed"),
])
def test_config_errors_name_the_field(rl: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"rl": rl})
    assert info.value.field is not None and info.value.field.startswith(field), info.value


def test_the_roles_task_comes_from_the_config() -> None:
    from intellect_node.roles.common.tasks import run_task

    cfg = build_config({"rl": {"env": "reasoning_gym:chain_sum", "env_args": {"seed": 9, "size": 30}}})
    task = run_task(cfg)
    p = task.problem(2)
    assert resolve_problem(p.problem_id) == p and p.system == rg.DEFAULT_SYSTEM_PROMPT
    assert p.reward(f"<answer>{p.answer}</answer>") == 1.0
    assert run_task(build_config({})).task_id == "add3"  # the embedded task stays the default


def payloads(marker: Path) -> list[str]:
    """Answers that create ``marker`` if a checker evaluates them as Python."""
    p = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return [p, f"[{p}]", f"[[{p}]]", f"({p})", f"x + {p}", f"{p} + 1", f"1 + ({p} or 0)", f"[{p}, 1]",
            f"[[0, {p}]]"]


def test_datasets_that_evaluate_answers_are_refused() -> None:
    for name in ("binary_matrix", "n_queens", "spiral_matrix", "string_insertion"):
        with pytest.raises(ConfigError, match="eval"):
            build_task(env=f"reasoning_gym:{name}")
    for name in ("simple_integration", "intermediate_integration"):
        with pytest.raises(ConfigError, match="parse_expr"):
            build_task(env=f"reasoning_gym:{name}")


@pytest.mark.parametrize("dataset", ["countdown", "puzzle24"])
def test_arithmetic_answers_are_screened_before_sympy_sees_them(dataset: str, tmp_path: Path) -> None:
    """countdown and puzzle24 give the answer to sympy's parse_expr (Python eval): only digits,
    operators and parentheses reach it; anything else scores as the dataset scores a malformed answer."""
    from reasoning_gym import create_dataset

    task = build_task(env=f"reasoning_gym:{dataset}", env_args={"seed": 0, "size": 5})
    ds = create_dataset(dataset, seed=0, size=5)
    p, entry = task.problem(0), ds[0]
    for i, text in enumerate(payloads(tmp_path / "pwned")):
        assert p.reward(f"<answer>{text}</answer>") == ds.score_answer("", entry) == 0.01, i
    assert not (tmp_path / "pwned").exists()
    assert p.reward(f"<answer>{entry['answer']}</answer>") == 1.0
    assert p.reward("<answer>1 + 1</answer>") == ds.score_answer("1 + 1", entry)


def test_no_available_dataset_runs_an_answer_as_code(tmp_path: Path) -> None:
    """Every dataset this client runs, three problems each, scored on answers that would touch a file
    if evaluated: none does. (Found the refused eval and parse_expr datasets; rerun after an upgrade.)"""
    for name in rg.available():
        task = build_task(env=f"reasoning_gym:{name}", env_args={"seed": 3, "size": 10})
        for i in range(3):
            p = task.problem(i)
            for text in payloads(tmp_path / f"{name}-{i}"):
                p.judge(f"<answer>{text}</answer>")
    assert not list(tmp_path.iterdir())
