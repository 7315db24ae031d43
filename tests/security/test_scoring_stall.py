"""Scoring is not a free stall.

A fresh key signs batches whose completions are each a distinct answer that math-verify cannot finish
(``\\boxed{9^{9^{9^{8}}}}``) and claims reward 1. Every answer used to cost the validator the whole
``reward_timeout_s`` and a scoring-process restart, for a ``reward_unjudged`` verdict held against no one,
while two such keys held both verification slots and both scoring processes every worker shares: an
honest worker's verdict waited for their batches (four answers at 60 s each, here).

Now workers with accepted work and fresh keys have verification slots and scoring processes of their own,
and each batch is scored under a budget charged to its sender: here the honest verdict is published while
both attackers' answers are still in the new keys' scoring processes, and a batch past its allowance of
timeouts is refused (``scoring_budget``, held against the worker) with the rest of it never scored.

The validator role runs in this process behind a fake swarm (``_roles_inproc.py``) with its own dispatch
loop and jobs, the embedded model as the policy, and real scoring processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from intellect_node.envs.tasks import Problem
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.models.loader import ModelTokenizer, embedded_model_dir
from intellect_node.proofs.sampling import batch_seeds, derived_rollout_id
from intellect_node.protocol.rl import RolloutNotice, verdict_validator
from intellect_node.protocol.rollout import PROOF_CHUNK, RolloutRecord, SamplingParams, sign_rollout
from intellect_node.protocol.signing import SigningKey
from tests.security._roles_inproc import RUN, batch_bytes, validator_role

TRAINER, VALIDATOR, HONEST, A1, A2 = (SigningKey(bytes([i]) * 32) for i in range(41, 46))
CID = checkpoint_cid(embedded_model_dir())
MAX_NEW = 24
GROUP = 4
SLOW = [f"\\boxed{{9^{{9^{{9^{{{d}}}}}}}}}" for d in range(1, 9)]
"""Distinct answers sympy never finishes evaluating (each one is a fresh judgement: no memo hit)."""


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir()


def _task_file(tmp: Path) -> Path:
    path = tmp / "algebra.jsonl"
    lines = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "checker": "math"} for i in range(4)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _validator(tmp: Path, engine: TorchEngine, reward_timeout_s: float) -> Any:
    validator = validator_role(tmp, VALIDATOR, TRAINER.peer_id, tasks_file=str(_task_file(tmp)),
                               group_size=GROUP, max_new_tokens=MAX_NEW, reward_timeout_s=reward_timeout_s)
    validator.engines[0] = (CID, engine)
    validator.latest_announced = 0
    return validator


def _problem(validator: Any, key: SigningKey) -> Problem:
    """The problem ``key``'s batch is about: its first assignment window at v0 (one problem a window in
    these tests' run, ``envs/assignment.py``), so every check before scoring passes."""
    problem: Problem
    (problem,) = validator.assignments.problems(key.peer_id, 0, 0)
    return problem


def _attack(validator: Any, key: SigningKey, answers: list[str]) -> list[RolloutRecord]:
    """A group whose completions are ``answers``, each claiming reward 1, with the seeds and rollout IDs
    the run derives: everything a validator checks before scoring passes."""
    tok = ModelTokenizer(embedded_model_dir())
    problems = [_problem(validator, key)] * len(answers)
    seeds = batch_seeds(RUN, 0, key.peer_id, [p.problem_id for p in problems])
    out = []
    for p, seed, text in zip(problems, seeds, answers):
        completion = tok.encode(text) + [min(tok.eos_ids)]
        out.append(sign_rollout(RolloutRecord(
            run_id=RUN, rollout_id=derived_rollout_id(key.peer_id, seed), task_id=p.task_id,
            problem_id=p.problem_id, prompt_tokens=tok.prompt_ids(p.prompt), completion_tokens=completion,
            logprobs=[-1.0] * len(completion),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW, seed=seed),
            policy_version=0, checkpoint_cid=CID, dtype="float32", reward=1.0,
            proofs=[b"p"] * -(-len(completion) // PROOF_CHUNK), worker=key.peer_id), key))
    return out


class Fetcher:
    """Serves the batches it was given by CID (the blob layer is not what this test is about)."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, records: list[RolloutRecord]) -> RolloutNotice:
        cid, data = batch_bytes(records)
        self.blobs[cid] = data
        return RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=len(records),
                             batch_bytes=len(data))

    async def fetch(self, cid: str, **kwargs: Any) -> bytes:
        return self.blobs[cid]

    def close(self) -> None:
        pass


def _verdicts(validator: Any) -> dict[str, Any]:
    """Published verdicts by worker."""
    read = verdict_validator(RUN, None)
    verdicts = (read(data, VALIDATOR.peer_id)[0] for _, data in validator.rt.swarm.published)
    return {v.worker: v for v in verdicts}


async def _until(cond: Callable[[], bool], what: str, limit_s: float) -> None:
    """Wait for ``cond``; ``limit_s`` only ends a test whose condition never comes."""
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(poll(), limit_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"not within {limit_s:.0f} s: {what}") from None


async def _running(validator: Any, fetcher: Fetcher,
                   body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """``validator`` with its job group and dispatch loop running (asyncio tasks of this loop)."""
    def spawn(name: str, factory: Callable[[], Coroutine[Any, Any, None]], **kwargs: Any) -> Any:
        return asyncio.get_running_loop().create_task(factory(), name=name)

    validator.rt.spawn = spawn
    validator.fetcher = fetcher
    await validator.tasks.open()
    validator.tasks.loop("validator-loop", validator._dispatch_loop)
    try:
        await body()
    finally:
        await validator.close()


def test_two_stalling_keys_do_not_delay_an_honest_verdict(tmp_path: Path, engine: TorchEngine) -> None:
    validator = _validator(tmp_path, engine, reward_timeout_s=60.0)
    honest = generate_rollouts(engine, engine.loaded.tokenizer, [_problem(validator, HONEST)] * GROUP,
                               key=HONEST, run_id=RUN, policy_version=0, checkpoint=CID,
                               sampling=SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW))
    validator.reputation.trust.put(HONEST.peer_id, 1)  # it has had a batch accepted here
    fetcher = Fetcher()
    attacks = {key.peer_id: fetcher.put(_attack(validator, key, SLOW[4 * i:4 * i + 4]))
               for i, key in enumerate((A1, A2))}
    honest_notice = fetcher.put(honest)

    async def body() -> None:
        for worker, notice in attacks.items():
            validator._on_notice((notice, worker), worker)
        # Both attackers' answers are in scoring processes (each call runs until its 60 s limit).
        scorers = validator.verification.scorers
        await _until(lambda: scorers["new"].busy == 2, "both attackers being scored", 120)
        validator._on_notice((honest_notice, HONEST.peer_id), HONEST.peer_id)
        await _until(lambda: HONEST.peer_id in _verdicts(validator), "the honest verdict", 50)
        published = _verdicts(validator)
        assert published[HONEST.peer_id].accepted, published[HONEST.peer_id]
        assert not set(attacks) & set(published), "an attacker's batch was done before the honest one"
        assert scorers["new"].busy == 2  # still at their first answers

    asyncio.run(_running(validator, fetcher, body))


def test_a_batch_past_its_timeouts_is_refused_and_held_against_its_sender(tmp_path: Path,
                                                                        engine: TorchEngine) -> None:
    validator = _validator(tmp_path, engine, reward_timeout_s=1.0)
    fetcher = Fetcher()
    notice = fetcher.put(_attack(validator, A1, SLOW[:4]))

    async def body() -> None:
        validator._on_notice((notice, A1.peer_id), A1.peer_id)
        await _until(lambda: A1.peer_id in _verdicts(validator), "the attacker's verdict", 120)

    asyncio.run(_running(validator, fetcher, body))
    verdict = _verdicts(validator)[A1.peer_id]
    assert (verdict.accepted, verdict.reason) == (False, "scoring_budget"), verdict
    assert "2 answers ran past the time limit, at most 1" in verdict.detail
    # Two answers scored (the allowed timeout, the one past it); the other two never were.
    scorers = validator.verification.scorers
    assert scorers["new"].killed == 2 and scorers["proven"].started == 0
    assert validator.reputation.rejections.get(A1.peer_id) == 1  # toward rl.ban_after
    assert any("scoring_budget" in why for peer, why in validator.rt.swarm.peerbook.rejections
               if peer == A1.peer_id)
    assert validator.status()["scoring"]["refused"] == 1
