"""``--config`` on the model commands: ``tasks solve-rates`` and ``proofs calibrate`` measure the run's
own task (its [rl] task file or reward environment, extraction and system prompt) instead of the embedded
addition task, with the CLI (in this process, ``tests.support.cli.invoke_cli``) on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli import invoke_cli


def _run_config(tmp_path: Path) -> Path:
    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c),
                                         "checker": "integer"}) + "\n"
                             for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 20, 30), (3, 3, 3)]))
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[rl]\ntasks_file = "{tasks}"\nmax_new_tokens = 4\nsolve_rate_band = [0.2, 0.9]\n')
    return cfg


def test_solve_rates_measures_the_runs_task_file(tmp_path: Path) -> None:
    cfg = _run_config(tmp_path)
    out = tmp_path / "rates.json"
    r = invoke_cli("tasks", "solve-rates", "--config", str(cfg), "--out", str(out), "--samples", "2", "-q")
    assert r.returncode == 0, r.stderr
    rates = json.loads(out.read_text())
    rates = rates.get("rates", rates)
    assert sorted(rates) == [f"sums/{i}" for i in range(5)]  # the file's problems, not add3's
    assert "5 problems of sums" in r.stdout and "inside 0.2-0.9" in r.stdout  # the run's band


def test_config_and_a_task_flag_name_two_tasks_and_are_refused(tmp_path: Path) -> None:
    cfg = _run_config(tmp_path)
    r = invoke_cli("tasks", "solve-rates", "--config", str(cfg), "--tasks", str(tmp_path / "sums.jsonl"),
                "--out", str(tmp_path / "r.json"), "-q")
    assert r.returncode == 2 and "--config" in r.stderr and "drop --task" in r.stderr
    r = invoke_cli("proofs", "calibrate", "--config", str(tmp_path / "missing.toml"), "--out",
                str(tmp_path / "t.json"))
    assert r.returncode == 2 and "no file at" in r.stderr


def test_calibrate_generates_from_the_runs_task(tmp_path: Path) -> None:
    cfg = _run_config(tmp_path)
    out = tmp_path / "thresholds.json"
    r = invoke_cli("proofs", "calibrate", "--config", str(cfg), "--n", "4", "--batch-sizes", "1,4",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data and "8 honest rollouts" in r.stdout  # 4 per batch size
    # the completions are as long as the run's (rl.max_new_tokens 4), not the flag's default
    assert {p["max_new_tokens"] for p in data["pairs"].values()} == {4}
