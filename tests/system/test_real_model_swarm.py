"""The whole swarm on a real-family model with a reasoning environment: a trainer, a validator and a
worker on a tiny random folder of each supported family (Qwen3: q/k norms, tied embeddings; Qwen2: QKV
bias; Llama: llama3 RoPE scaling; Mistral: sliding window; each with a BPE tokenizer, its chat template and
two EOS IDs) and ``reasoning_gym:basic_arithmetic``, with proof thresholds calibrated for that model by
``intellect-node proofs calibrate`` and pinned in the run config by their sha256
(``tests/support/real_swarm.py`` does what docs/real-runs.md tells an organiser to do).

Qwen3's run is ``intellect-node join`` processes on 127.0.0.1 (the organiser's files read by real nodes
over the wire); the other three families run the same roles in one process
(``intellect_node.testing.roles``), since what differs between families is the model code every role
runs, not the processes or the wire.

Checked: the trainer takes at least two GRPO steps on rollouts its validator accepted, the validator
accepts every honest rollout (0 rejections), the worker follows the new policy (it generates for a
version the trainer published) and what it generated were the environment's problems, scored by the
dataset's own checker on every role.

Why these reward settings. A random model never writes ``<answer>`` tags, so under the environment's
default extraction every completion scores 0, every group's rewards are equal, the trainer's online
filter (zero advantage) drops them all and it never steps. ``answer_format = "whole"`` hands the whole
completion to basic_arithmetic's own ``score_answer``, which gives partial credit len(answer) /
len(text) when the reference answer appears in the text; with sums of two one-digit numbers (answers
0..18) and 12 new tokens a random completion contains the answer now and then (measured: 8 of 128
rollouts, a quarter to a half of the groups of 8 not uniform), so steps happen on honest signal. A run
organiser warming up a base model that does not follow the format yet could choose the same; the system
prompt matches the format. Settings that decide a reward are hashed into the problem IDs, so all three
nodes must (and do) agree on them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.real_swarm import organise_run, start_node
from tests.support.roles import listen_addr
from tests.support.wait import wait_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENV_ARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False, "size": 10000}
RL: dict[str, Any] = dict(env="reasoning_gym:basic_arithmetic", env_args=ENV_ARGS, answer_format="whole",
                          think="keep", system_prompt="Answer with the number only.", group_size=8,
                          problems_per_batch=4, groups_per_step=4, max_new_tokens=12,
                          batches_per_version=4)
STEPS = 2


def _trained(trainer_dir: Path) -> list[dict[str, Any]]:
    path = trainer_dir / "trainer" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m for m in rows if m["trained"]]


def test_a_swarm_of_processes_on_a_reasoning_gym_task_steps_with_no_honest_rejection(tmp_path: Path) -> None:
    run = organise_run(tmp_path, ["trainer", "validator", "worker"], rl=RL, family="qwen3")
    procs: list[Any] = []
    try:
        trainer = start_node(run, "trainer", "trainer", procs, rl=RL)
        t_addr = listen_addr(trainer)
        validator = start_node(run, "validator", "validator", procs, rl=RL, bootstrap=[t_addr])
        v_addr = listen_addr(validator)
        worker = start_node(run, "worker", "worker", procs, rl=RL, bootstrap=[t_addr, v_addr])
        worker.wait_ready(180)

        wait_for(lambda: len(_trained(run.data_dir("trainer"))) >= STEPS, timeout=400,
                 what=f"{STEPS} trained steps")
        # The worker follows: it loads a version the trainer published after the first step.
        wait_for(lambda: worker.status()["worker"]["policy_version"] >= STEPS - 1, timeout=120,
                 what="the worker on a new policy")
        wait_for(lambda: worker.status()["worker"]["accepted"] >= 2, timeout=120,
                 what="verdicts back at the worker")
        # The worker records the problems it draws per version when it draws them: a moment after it
        # loaded the version (status above), so wait for the record too.
        used_file = run.data_dir("worker") / "worker" / "used.json"
        wait_for(lambda: _drawn_for_a_new_version(used_file), timeout=120,
                 what="the worker drawing problems for a new version")
        vstat = validator.status()["validator"]
        wstat = worker.status()["worker"]
        tstat = trainer.status()["trainer"]
    finally:
        for p in procs:
            p.close()
    _check(run.data_dir("trainer"), tstat, vstat, wstat, json.loads(used_file.read_text()))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_swarm_in_one_process_on_a_reasoning_gym_task_steps_with_no_honest_rejection(
        tmp_path: Path, family: str) -> None:
    run = organise_run(tmp_path, ["trainer", "validator", "worker"], rl=RL, family=family, in_process=True)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL,
                     run_id="qwen3-rg", model=str(run.model), proof_thresholds=str(run.thresholds),
                     proof_thresholds_sha256=run.sha256)
    used_file = run.data_dir("worker") / "worker" / "used.json"

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            validator = await net.start("validator", cfg, Validator.for_runtime)
            worker = await net.start("worker", cfg, Worker.for_runtime)
            await wait_until(lambda: len(_trained(run.data_dir("trainer"))) >= STEPS, timeout=400,
                             what=f"{STEPS} trained steps")
            await wait_until(lambda: worker.status()["policy_version"] >= STEPS - 1, timeout=120,
                             what="the worker on a new policy")
            await wait_until(lambda: worker.status()["accepted"] >= 2, timeout=120,
                             what="verdicts back at the worker")
            await wait_until(lambda: _drawn_for_a_new_version(used_file), timeout=120,
                             what="the worker drawing problems for a new version")
            assert not net.failures(), net.failures()
            return trainer.status(), validator.status(), worker.status()

    tstat, vstat, wstat = asyncio.run(main())
    _check(run.data_dir("trainer"), tstat, vstat, wstat, json.loads(used_file.read_text()))


def _drawn_for_a_new_version(used_file: Path) -> bool:
    return used_file.exists() and json.loads(used_file.read_text())["version"] >= STEPS - 1


def _check(trainer_dir: Path, tstat: dict[str, Any], vstat: dict[str, Any], wstat: dict[str, Any],
           used: dict[str, Any]) -> None:
    trained = _trained(trainer_dir)
    assert all(m["samples"] >= RL["group_size"] and 0.0 <= m["reward_mean"] <= 1.0 for m in trained), trained
    # Partial credit did its work: some rewards were neither 0 nor 1 (the dataset's own checker).
    assert any(0.0 < m["reward_mean"] < 1.0 for m in trained), trained
    assert tstat["version"] >= STEPS and tstat["rejected_batches"] == 0, tstat

    # Honest work only: nothing rejected, by the validator or at the worker.
    assert vstat["accepted"] > 0 and vstat["rejected"] == 0, vstat
    assert not vstat["rejections_by_worker"], vstat
    assert wstat["rejected"] == 0 and wstat["accepted"] > 0, wstat

    # Generated for a version after the first step, on the environment's problems.
    assert wstat["policy_version"] >= STEPS - 1, wstat
    assert used["version"] >= STEPS - 1, used
    assert used["problems"] and all(p.startswith("reasoning_gym:basic_arithmetic@") for p in used["problems"])
