"""JSONL task files and the offline (solve-rate band) and online (all-equal group) filters."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from intellect_node.envs.filtering import (
    SolveRateBand,
    load_solve_rates,
    measure_solve_rates,
    offline_filter,
    save_solve_rates,
)
from intellect_node.envs.jsonl_tasks import load_jsonl_tasks
from intellect_node.envs.tasks import Problem, Task, embedded_task, get_task, resolve_problem
from intellect_node.errors import ConfigError
from intellect_node.trainer.filtering import filter_groups


def test_jsonl_task_loads_scores_and_resolves(tmp_path: Path) -> None:
    f = tmp_path / "mytasks.jsonl"
    f.write_text('{"prompt": "2+2=", "answer": 4, "checker": "integer"}\n\n'
                 '{"id": "cap", "prompt": "Capital of France?", "answer": "Paris"}\n')
    task = load_jsonl_tasks(f)
    assert isinstance(task, Task) and len(task) == 2 and task.task_id == "mytasks"
    p0, p1 = task.problem(0), task.problem(1)
    assert p0.problem_id == "mytasks/0" and p0.reward(" 004 ") == 1.0 and p0.reward("5") == 0.0
    assert p1.checker == "exact" and p1.reward("Paris\n") == 1.0 and p1.reward("paris") == 0.0
    assert get_task("mytasks") is task and resolve_problem("mytasks/1") == p1
    assert len(task.sha256) == 64
    assert all(p in (p0, p1) for p in task.sample(random.Random(0), 5))


@pytest.mark.parametrize("line,needle", [
    ("not json", "not JSON"), ('["a"]', "object"), ('{"prompt": "", "answer": "1"}', "prompt"),
    ('{"prompt": "x", "answer": null}', "answer"),
    ('{"prompt": "x", "answer": "1", "checker": "llm"}', "checker"),
    ('{"prompt": "x", "answer": "1", "extra": 1}', "unknown field"),
])
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(ConfigError) as exc:
        load_jsonl_tasks(f, register=False)
    assert f"{f}:2" in str(exc.value) and needle in str(exc.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_jsonl_tasks(tmp_path / "missing.jsonl")


def test_offline_filter_keeps_the_band(tmp_path: Path) -> None:
    task = embedded_task()
    pool = [task.problem(i) for i in range(0, 10_000, 1000)]  # 10 problems
    # A stand-in policy whose solve rate for problem i is i/10 (the real one is the model; the filter's
    # job is the bookkeeping, which this pins down exactly).
    rate_of = {p.problem_id: k / 10 for k, p in enumerate(pool)}

    def rewards_fn(problems: Sequence[Problem], n: int) -> list[list[float]]:
        return [[1.0 if j < round(rate_of[p.problem_id] * n) else 0.0 for j in range(n)] for p in problems]

    rates = measure_solve_rates(pool, rewards_fn, samples=10, batch=3)
    assert rates == pytest.approx(rate_of)
    kept = offline_filter(task, rates, SolveRateBand(0.1, 0.8), pool=pool)
    assert [kept.problem(i).problem_id for i in range(len(kept))] == [p.problem_id for p in pool[1:9]]
    assert kept.get(pool[0].problem_id) == pool[0]  # IDs still resolve through the base task
    assert pool[0].problem_id not in kept and pool[5].problem_id in kept
    save_solve_rates(tmp_path / "rates.json", rates)
    assert load_solve_rates(tmp_path / "rates.json") == rates
    with pytest.raises(ConfigError, match="kept no problem"):
        offline_filter(task, rates, SolveRateBand(0.95, 1.0), pool=pool[:3])
    with pytest.raises(ConfigError):
        SolveRateBand(0.9, 0.1)


def test_online_filter_drops_all_equal_groups() -> None:
    groups = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.25, 0.5]]
    got = filter_groups(groups, float)
    assert got.useful == [[0.0, 1.0, 0.0], [0.5, 0.25, 0.5]]
    assert (got.total, got.dropped, got.cause) == (4, 2, "")


@pytest.mark.parametrize("groups,cause", [
    ([[0.0, 0.0], [0.0, 0.0]], "all_zero"),
    ([[1.0, 1.0], [1.0, 1.0]], "all_one"),
    ([[0.5, 0.5], [0.5, 0.5]], "all_equal"),
    ([[0.0, 0.0], [1.0, 1.0]], "all_equal"),  # some too hard, some too easy: nothing between
    ([], "no_groups"),  # every group left out (its reward could not be judged)
])
def test_online_filter_says_why_it_dropped_every_group(groups: list[list[float]], cause: str) -> None:
    got = filter_groups(groups, float)
    assert got.useful == [] and got.dropped == len(groups) and got.cause == cause


def test_offline_filter_in_a_run_from_the_cli_to_the_runs_task(tmp_path: Path) -> None:
    """``tasks solve-rates`` measures with the starting policy; ``rl.solve_rates_file`` narrows the run."""
    import json
    import subprocess

    from intellect_node.config import load_config
    from intellect_node.envs.filtering import FilteredTask
    from intellect_node.roles.common.tasks import run_task
    from tests.support.common import CLI

    rates_path = tmp_path / "rates.json"
    r = subprocess.run([CLI, "tasks", "solve-rates", "--out", str(rates_path), "--pool", "48",
                        "--samples", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "48 problems of add3" in r.stdout and "rl.solve_rates_file" in r.stdout
    rates = load_solve_rates(rates_path)
    assert len(rates) == 48 and all(0.0 <= v <= 1.0 and v * 8 == round(v * 8) for v in rates.values())
    # The embedded model solves some but not all: the band keeps a real subset.
    inside = {k for k, v in rates.items() if 0.1 <= v <= 0.8}
    assert inside and len(set(rates.values())) > 1

    doc = tmp_path / "run.toml"
    doc.write_text(f'[rl]\nsolve_rates_file = "{rates_path}"\nsolve_rate_band = [0.1, 0.8]\n')
    task = run_task(load_config(doc, environ={}))
    assert isinstance(task, FilteredTask) and len(task) == len(inside)
    assert {p.problem_id for p in task.sample(random.Random(1), 200)} <= inside
    outside = next((k for k in rates if k not in inside), "add3/999999")
    assert outside not in task and all(pid in task for pid in inside)

    # Operator mistakes name the field.
    bad = tmp_path / "bad.toml"
    bad.write_text('[rl]\nsolve_rate_band = [0.8, 0.1]\n')
    with pytest.raises(ConfigError) as e:
        load_config(bad, environ={})
    assert "solve_rate_band" in str(e.value)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"mytasks/0": 0.5}))
    other_doc = tmp_path / "other.toml"
    other_doc.write_text(f'[rl]\nsolve_rates_file = "{other}"\n')
    with pytest.raises(ConfigError) as e:
        run_task(load_config(other_doc, environ={}))
    assert e.value.field == "rl.solve_rates_file" and "measure the rates for this run's task" in str(e.value)
    r = subprocess.run([CLI, "tasks", "solve-rates", "--out", str(rates_path), "--samples", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--samples" in r.stderr
