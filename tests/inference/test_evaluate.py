"""Held-out evaluation (``inference/evaluate.py``, ``intellect-node model eval``): deterministic, follows the
weights it is given, keeps partial credit apart from full credit, and refuses a bad weights file with exit
code 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from intellect_node.envs.tasks import embedded_task
from intellect_node.errors import ConfigError
from intellect_node.inference.evaluate import Evaluation, held_out, pass_rate, with_weights
from intellect_node.models.loader import load_model
from tests.support.cli import invoke_cli


def test_same_policy_same_number_and_weights_file_is_what_is_evaluated(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    base = load_model(None)
    a, b = pass_rate(base, n=64), pass_rate(base, n=64)
    assert a == b and 0.0 < a < 1.0
    # The same weights through a file: the same figure; noised weights: a much worse one.
    save_file({k: v.contiguous() for k, v in base.state.items()}, str(tmp_path / "same.safetensors"))
    assert pass_rate(with_weights(base, tmp_path / "same.safetensors"), n=64) == a
    noisy = {k: (v + 0.5 * torch.randn_like(v)).contiguous() for k, v in base.state.items()}
    save_file(noisy, str(tmp_path / "noisy.safetensors"))
    assert pass_rate(with_weights(base, tmp_path / "noisy.safetensors"), n=64) < a / 2


def test_cli_names_the_bad_flag(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    for bad, needle in ((tmp_path / "missing.safetensors", "No such file"),
                        (tmp_path / "other.safetensors", "lacks")):
        r = invoke_cli("model", "eval", "--n", "8", "--weights", str(bad))
        assert r.returncode == 2 and "--weights" in r.stderr and needle in r.stderr, r.stderr
    ok = invoke_cli("model", "eval", "--n", "16")
    assert ok.returncode == 0 and "pass rate" in ok.stdout and "on 16 problems" in ok.stdout


def test_held_out_keeps_every_reward_and_counts_full_credit() -> None:
    torch.set_num_threads(1)
    partial = Evaluation((1.0, 0.5, 0.0, 1.0))
    assert partial.mean_reward == 0.625 and partial.pass_rate == 0.5
    base, task = load_model(None), embedded_task()
    a, b = held_out(base, task, n=32, max_new_tokens=5), held_out(base, task, n=32, max_new_tokens=5)
    assert a == b and len(a.rewards) == 32 and a.pass_rate == a.mean_reward  # add3 scores 0 or 1
    with pytest.raises(ConfigError, match="--n"):
        held_out(base, task, n=len(task) + 1)


CHILD_EVAL = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from intellect_node.config import build_config
from intellect_node.inference import make_engine
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.evaluate import chunk_rewards, held_out_keys
from intellect_node.models.loader import load_model
from intellect_node.roles.common.tasks import held_out_task
cfg = build_config({"run": {"run_id": "det", "eval_every": 1, "eval_problems": 64},
                    "rl": {"max_new_tokens": 8}})
part = held_out_task(cfg)
problems = [part.problem(j) for j in range(64)]
engine = make_engine(load_model(None), "torch")
sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=8)
chunks = [int(c) for c in sys.argv[2].split(",")]
got = chunk_rewards(engine, problems, held_out_keys(cfg.run.eval_seed, 64), sampling, chunks)
print(json.dumps({str(i): j.reward for i, j in sorted(got.items())}))
"""


def test_a_chunk_evaluated_again_in_another_process_gives_the_same_rewards() -> None:
    """What the validators' re-check of a held-out result rests on (``roles/validator/evals.py``): the
    run's held-out problems, keys and chunks give the same rewards in another process, with another torch
    thread count and hash seed, evaluated alone or with the other chunks."""
    import json
    import os
    import sys

    def child(threads: int, chunks: str, seed: str) -> dict[str, float]:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", CHILD_EVAL, str(threads), chunks], capture_output=True,
                             text=True, check=True, timeout=300, env=env)
        got: dict[str, float] = json.loads(out.stdout)
        return got

    whole = child(1, ",".join(str(c) for c in range(8)), "1")
    assert len(whole) == 64 and 0.0 < sum(whole.values()) < 64
    again = child(2, "3,6", "2")
    assert again == {i: r for i, r in whole.items() if int(i) // 8 in (3, 6)}
