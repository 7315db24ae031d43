"""A reasoning-gym environment through the roles' scoring paths on the embedded model: the worker's
rewards are what the validator and the trainer recompute, a wrong claimed reward is caught, and a
validator with other environment settings does not score the worker's problems at all."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from intellect_node.envs.environment import build_task
from intellect_node.envs.tasks import Task
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.models.loader import embedded_model_dir
from intellect_node.proofs.thresholds import load_thresholds
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.records import rescored_group
from tests.support.rollouts import resign

torch.set_num_threads(1)

SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=48)
WORKER = SigningKey(bytes(range(32)))
CID = checkpoint_cid(embedded_model_dir())
ENV: dict[str, Any] = dict(env="reasoning_gym:chain_sum", env_args={"seed": 1, "size": 100, "max_digits": 2})


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir()


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(**ENV)


def verifier(engine: TorchEngine, **kw: Any) -> Verifier:
    return Verifier(engine, load_thresholds(engine.loaded.path, "float32"),
                    Expectations(run_id="run", policy_version=0, checkpoint_cid=CID, temperature=1.0,
                                 top_p=1.0, max_new_tokens=48), **kw)


@pytest.fixture(scope="module")
def honest(engine: TorchEngine, task: Task) -> list[RolloutRecord]:
    return generate_rollouts(engine, engine.loaded.tokenizer, [task.problem(i) for i in range(4)],
                             key=WORKER, run_id="run", policy_version=0, checkpoint=CID, sampling=SAMPLING,
                             seeds=list(range(4)))


def answered(engine: TorchEngine, r: RolloutRecord, text: str, reward: float) -> RolloutRecord:
    """``r`` with ``text`` as its completion and ``reward`` claimed (the tensor checks would refuse it;
    the cheap checks, which include re-scoring, are what is tested here)."""
    tok = engine.loaded.tokenizer
    out = tok.encode(text) + [tok.eos_id]
    proofs = [r.proofs[0]] * math.ceil(len(out) / 32)  # one TOPLOC proof per 32 tokens, structurally
    return resign(r, WORKER, completion_tokens=out, logprobs=[0.0] * len(out), proofs=proofs, reward=reward)


def test_worker_validator_and_trainer_give_the_same_rewards(engine: TorchEngine, task: Task,
                                                          honest: list[RolloutRecord]) -> None:
    verdicts = verifier(engine).verify(honest)  # resolves through the registry, as a validator does
    assert all(v.accepted for v in verdicts), verdicts
    p = task.get(honest[0].problem_id)
    right = answered(engine, honest[0], f"<think>add them</think><answer>{p.answer}</answer>", 1.0)
    wrong_claim = answered(engine, honest[0], f"<answer>{p.answer}</answer>", 0.0)
    verdicts = verifier(engine).verify([right, wrong_claim], tensor_checks=set())
    assert verdicts[0].accepted
    assert (verdicts[1].accepted, verdicts[1].reason) == (False, "reward")
    decode = engine.loaded.tokenizer.decode
    groups = [rescored_group([r], task.get(r.problem_id), decode) for r in [*honest, right]]
    assert [g[0].reward for g in groups if g is not None] == [r.reward for r in honest] + [1.0]


def test_the_trainer_leaves_out_a_group_its_checker_could_not_judge(engine: TorchEngine, task: Task,
                                                                     honest: list[RolloutRecord]) -> None:
    """The trainer re-scores every rollout; where its checker times out (a busy trainer, a completion a
    faster validator scored) the group's rewards are unknown there: left out, not trained on as 0."""
    import dataclasses

    from intellect_node.envs.tasks import Judgement

    decode = engine.loaded.tokenizer.decode
    p = task.get(honest[0].problem_id)
    group = [r for r in honest if r.problem_id == p.problem_id]
    got = rescored_group(group, p, decode)
    assert got is not None and [s.reward for s in got] == [r.reward for r in group]
    slow = dataclasses.replace(p, scorer=lambda text: Judgement(0.0, "timeout"))
    assert rescored_group(group, slow, decode) is None
    # A zero for the completion's own reason is a reward like any other.
    empty = dataclasses.replace(p, scorer=lambda text: Judgement(0.0, "no_answer"))
    got = rescored_group(group, empty, decode)
    assert got is not None and {s.reward for s in got} == {0.0}


def test_a_validator_with_other_settings_refuses_the_problems(engine: TorchEngine,
                                                              honest: list[RolloutRecord]) -> None:
    other = build_task(env="reasoning_gym:chain_sum", env_args={"seed": 2, "size": 100, "max_digits": 2})
    verdicts = verifier(engine, resolve=other.get).verify(honest, tensor_checks=set())
    assert {(v.accepted, v.reason) for v in verdicts} == {(False, "unknown_task")}
    renamed = resign(honest[0], WORKER, problem_id=honest[0].problem_id.replace("/0", "/00"))
    assert verifier(engine).verify([renamed], tensor_checks=set())[0].reason == "unknown_task"
