"""A run on a real-family model, set up the way a run organiser sets one up (docs/real-runs.md).

:func:`organise_run` builds a tiny random folder of a family (``tests/support/families.py``), calibrates
its proof thresholds with the real CLI (``intellect-node proofs calibrate``) and creates every node's key,
as a run organiser does before publishing the run; a run whose roles run in one process
(``intellect_node.testing.roles``) reads the same model, thresholds and hash, and
``tests/system/test_run_by_cid.py`` makes its run with ``run init``.
:data:`RL` is such a run's ``[rl]`` on ``reasoning_gym:basic_arithmetic`` and :func:`check_run` what it
shows after :data:`STEPS` steps, however the run was made.

The model is wider than the families' default (hidden 128, not 64): a TOPLOC proof chunk holds
``tokens * hidden_size`` values and needs at least the top-k's 128, so with hidden 64 a completion that
is one token long (the model's first token an EOS, about one rollout in 200 for a random model with two
EOS IDs in 384) cannot be proved and the worker's whole batch fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.common import CLI
from tests.support.families import build_family_model
from tests.support.roles import ENV, make_key

SHAPE = {"hidden_size": 128, "intermediate_size": 256}
"""Tiny Qwen3 over the families' default shape: hidden 128 = TOPLOC's top-k (module docstring)."""

ARITHMETIC_ARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                   "allow_parentheses": False, "allow_negation": False, "size": 10000}
"""``reasoning_gym:basic_arithmetic``'s arguments for a random model: sums of two one-digit numbers."""
RL: dict[str, Any] = dict(env="reasoning_gym:basic_arithmetic", env_args=ARITHMETIC_ARGS,
                          answer_format="whole", think="keep", system_prompt="Answer with the number only.",
                          group_size=8, problems_per_batch=4, groups_per_step=4, max_new_tokens=12,
                          batches_per_version=4)
"""A real-family run's ``[rl]``: why these reward settings, ``tests/system/test_real_model_swarm.py``."""
STEPS = 2
"""Trained steps a real-family run waits for: the worker then follows a version published after a step."""


@dataclass
class Run:
    """What an organiser hands out: the model folder, the thresholds file and its hash, the peer IDs."""

    root: Path
    model: Path
    thresholds: Path
    sha256: str
    ids: dict[str, str] = field(default_factory=dict)  # node name -> peer ID

    def data_dir(self, name: str) -> Path:
        return self.root / name


def calibrate(model: Path, out: Path, *, max_new_tokens: int, in_process: bool = False) -> str:
    """``intellect-node proofs calibrate`` for the torch@cpu pair; returns the file's sha256 (which the
    command also prints, as the run's ``proof_thresholds_sha256``). ``in_process``: the command in this
    process (``tests.support.cli.invoke_cli``), for a run whose nodes run here too."""
    args = ["proofs", "calibrate", "--model", str(model), "--n", "16", "--batch-sizes", "1,8",
            "--max-new-tokens", str(max_new_tokens), "--out", str(out)]
    if in_process:
        from tests.support.cli import invoke_cli

        res = invoke_cli(*args)
    else:
        res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300,
                             env={**os.environ, **ENV})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert f"sha256 {digest}" in res.stdout, res.stdout
    return digest


def organise_run(root: Path, names: list[str], *, rl: dict[str, Any], family: str = "qwen3",
                 in_process: bool = False) -> Run:
    """Model (a tiny random ``family`` folder), thresholds and keys for a run whose trainer is
    ``names[0]`` and validator ``names[1]``. ``in_process``: calibrated in this process (see
    :func:`calibrate`)."""
    model = build_family_model(family, root / f"model-{family}", shape=SHAPE)
    thresholds = root / "proof_thresholds.json"
    run = Run(root, model, thresholds, calibrate(model, thresholds, max_new_tokens=int(rl["max_new_tokens"]),
                                                 in_process=in_process))
    run.ids = {n: make_key(root / n) for n in names}
    return run


def trained(trainer_dir: Path) -> list[dict[str, Any]]:
    """The trained steps of the trainer's ``metrics.jsonl`` (``trainer_dir``: its data dir)."""
    path = trainer_dir / "trainer" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m for m in rows if m["trained"]]


def drawn_for_a_new_version(used_file: Path) -> bool:
    """The worker recorded problems drawn for a version published after the first step."""
    return used_file.exists() and json.loads(used_file.read_text())["version"] >= STEPS - 1


def check_run(trainer_dir: Path, tstat: dict[str, Any], vstat: dict[str, Any], wstat: dict[str, Any],
              used: dict[str, Any], *, group_size: int) -> None:
    """What a real-family run on ``reasoning_gym:basic_arithmetic`` shows once :data:`STEPS` steps are
    trained: from the trainer's, validator's and worker's status, the worker's ``used.json``."""
    steps = trained(trainer_dir)
    assert all(m["samples"] >= group_size and 0.0 <= m["reward_mean"] <= 1.0 for m in steps), steps
    # Partial credit did its work: some rewards were neither 0 nor 1 (the dataset's own checker).
    assert any(0.0 < m["reward_mean"] < 1.0 for m in steps), steps
    assert tstat["version"] >= STEPS and tstat["rejected_batches"] == 0, tstat

    # Honest work only: nothing rejected, by the validator or at the worker.
    assert vstat["accepted"] > 0 and vstat["rejected"] == 0, vstat
    assert not vstat["rejections_by_worker"], vstat
    assert wstat["rejected"] == 0 and wstat["accepted"] > 0, wstat

    # Generated for a version after the first step, on the environment's problems.
    assert wstat["policy_version"] >= STEPS - 1, wstat
    assert used["version"] >= STEPS - 1, used
    assert used["problems"] and all(p.startswith("reasoning_gym:basic_arithmetic@") for p in used["problems"])
