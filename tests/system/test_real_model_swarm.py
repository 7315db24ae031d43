"""The whole swarm on a real-family model with a reasoning environment: a trainer, a validator and a
worker on a tiny random folder of a supported family (Qwen2: QKV bias; Llama: llama3 RoPE scaling;
Mistral: sliding window; each with a BPE tokenizer, its chat template and two EOS IDs) and
``reasoning_gym:basic_arithmetic``, with proof thresholds calibrated for that model by ``intellect-node
proofs calibrate`` and pinned in the run config by their sha256 (``tests/support/real_swarm.py`` does
what docs/real-runs.md tells an organiser to do).

The roles run in one process (``intellect_node.testing.roles``), since what differs between families is
the model code every role runs, not the processes or the wire. Qwen3 (q/k norms, tied embeddings) runs
the same settings as ``intellect-node join`` processes in ``tests/system/test_run_by_cid.py``, whose run
is made by ``run init`` and joined by its CID, and is checked there the same way
(``tests.support.real_swarm.check_run``).

Checked: the trainer takes at least two GRPO steps on rollouts its validator accepted, the validator
accepts every honest rollout (0 rejections), the worker follows the new policy (it generates for a
version the trainer published) and what it generated were the environment's problems, scored by the
dataset's own checker on every role.

Why these reward settings (``tests.support.real_swarm.RL``). A random model never writes ``<answer>``
tags, so under the environment's default extraction every completion scores 0, every group's rewards
are equal, the trainer's online filter (zero advantage) drops them all and it never steps.
``answer_format = "whole"`` hands the whole completion to basic_arithmetic's own ``score_answer``, which
gives partial credit len(answer) / len(text) when the reference answer appears in the text; with sums of
two one-digit numbers (answers 0..18) and 12 new tokens a random completion contains the answer now and
then (measured: 8 of 128 rollouts, a quarter to a half of the groups of 8 not uniform), so steps happen on
honest signal. A run organiser warming up a base model that does not follow the format yet could choose
the same; the system prompt matches the format. Settings that decide a reward are hashed into the
problem IDs, so all three nodes must (and do) agree on them.
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
from tests.support.real_swarm import RL, STEPS, check_run, drawn_for_a_new_version, organise_run, trained
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_swarm_in_one_process_on_a_reasoning_gym_task_steps_with_no_honest_rejection(
        tmp_path: Path, family: str) -> None:
    run = organise_run(tmp_path, ["trainer", "validator", "worker"], rl=RL, family=family, in_process=True)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL,
                     run_id="qwen3-rg", model=str(run.model), proof_thresholds=str(run.thresholds),
                     proof_thresholds_sha256=run.sha256)
    # One scoring process a pool (new workers', proven workers'): each is a Python that imports
    # reasoning_gym before its first answer, and one worker's batches never need a second.
    vcfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update={"scoring_processes": 1})})
    used_file = run.data_dir("worker") / "worker" / "used.json"

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            validator = await net.start("validator", vcfg, Validator.for_runtime)
            worker = await net.start("worker", cfg, Worker.for_runtime)
            await wait_until(lambda: len(trained(run.data_dir("trainer"))) >= STEPS, timeout=400,
                             what=f"{STEPS} trained steps")
            await wait_until(lambda: worker.status()["policy_version"] >= STEPS - 1, timeout=120,
                             what="the worker on a new policy")
            await wait_until(lambda: worker.status()["accepted"] >= 2, timeout=120,
                             what="verdicts back at the worker")
            await wait_until(lambda: drawn_for_a_new_version(used_file), timeout=120,
                             what="the worker drawing problems for a new version")
            assert not net.failures(), net.failures()
            return trainer.status(), validator.status(), worker.status()

    tstat, vstat, wstat = asyncio.run(main())
    check_run(run.data_dir("trainer"), tstat, vstat, wstat, json.loads(used_file.read_text()),
              group_size=RL["group_size"])
