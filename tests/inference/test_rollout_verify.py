"""The validator's verdicts on the embedded model: honest rollouts pass at batch 1 and 32; each way of
cheating listed in the issue is rejected, with the check that catches it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from intellect_node.envs.mathcheck import check_math
from intellect_node.envs.sandbox import Lane, Meter, ScoringPool
from intellect_node.envs.tasks import Judgement, Problem, embedded_task, resolve_problem
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier, verify_rollout
from intellect_node.models.loader import embedded_model_dir
from intellect_node.proofs.thresholds import load_thresholds
from intellect_node.proofs.toploc import build_proofs
from intellect_node.protocol.rollout import RolloutRecord, sign_rollout
from intellect_node.protocol.signing import SigningKey
from tests.support.rollouts import noisy_model, random_model, resign

SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=16)
WORKER = SigningKey(bytes(range(32)))
MALLORY = SigningKey(bytes(range(5, 37)))
CID = checkpoint_cid(embedded_model_dir())
TAMPER_REASONS = {"toploc", "logprob", "sampling"}


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir()


@pytest.fixture(scope="module")
def verifier(engine: TorchEngine) -> Verifier:
    th = load_thresholds(engine.loaded.path, "float32")  # the shipped, calibrated defaults
    return Verifier(engine, th, Expectations(run_id="run", policy_version=3, checkpoint_cid=CID,
                                             temperature=1.0, top_p=1.0, max_new_tokens=16))


def rollouts(engine: TorchEngine, n: int, seed: int, key: SigningKey = WORKER) -> list[RolloutRecord]:
    problems = embedded_task().sample(random.Random(seed), n)
    return generate_rollouts(engine, engine.loaded.tokenizer, problems, key=key, run_id="run",
                             policy_version=3, checkpoint=CID, sampling=SAMPLING,
                             seeds=[seed * 1000 + i for i in range(n)])


@pytest.fixture(scope="module")
def honest(engine: TorchEngine) -> list[RolloutRecord]:
    return rollouts(engine, 32, seed=1)


def test_honest_rollouts_pass_at_batch_32_and_1(engine: TorchEngine, verifier: Verifier,
                                                honest: list[RolloutRecord]) -> None:
    verdicts = verifier.verify(honest)
    assert all(v.accepted for v in verdicts), [v for v in verdicts if not v.accepted]
    singles = [rollouts(engine, 1, seed=s)[0] for s in (2, 3, 4)]
    assert all(verify_rollout(r, verifier).accepted for r in singles)
    # and the same rollout sampled alone is the same rollout
    alone = generate_rollouts(engine, engine.loaded.tokenizer, [embedded_task().get(honest[5].problem_id)],
                              key=WORKER, run_id="run", policy_version=3, checkpoint=CID, sampling=SAMPLING,
                              seeds=[honest[5].sampling.seed], rollout_ids=[honest[5].rollout_id])[0]
    assert alone.completion_tokens == honest[5].completion_tokens and alone.proofs == honest[5].proofs
    rewards = [r.reward for r in honest]
    assert 0 < sum(rewards) < len(rewards)  # the embedded model is neither hopeless nor done


def _rejected(verifier: Verifier, recs: list[RolloutRecord]) -> list[str]:
    verdicts = verifier.verify(recs)
    assert all(not v.accepted for v in verdicts), [v for v in verdicts if v.accepted]
    return [v.reason or "" for v in verdicts]


def test_a_different_model_is_rejected(verifier: Verifier, tmp_path: Path) -> None:
    other = TorchEngine.from_dir(str(random_model(tmp_path / "other", seed=3)))
    recs = rollouts(other, 8, seed=5)
    assert set(_rejected(verifier, recs)) == {"toploc"}


def test_weights_plus_small_noise_are_rejected(verifier: Verifier, tmp_path: Path) -> None:
    noisy = TorchEngine.from_dir(str(noisy_model(tmp_path / "noisy", std=1e-3)))
    recs = rollouts(noisy, 16, seed=6)
    assert set(_rejected(verifier, recs)) <= TAMPER_REASONS


def test_one_output_token_changed_is_rejected(verifier: Verifier, engine: TorchEngine,
                                              honest: list[RolloutRecord]) -> None:
    tok = engine.loaded.tokenizer
    task = embedded_task()
    forged = []
    for r in honest[:16]:
        toks = list(r.completion_tokens)
        i = min(2, len(toks) - 2)
        digit = tok.decode([toks[i]])
        toks[i] = tok.encode(str((int(digit) + 1) % 10) if digit.isdigit() else "7")[0]
        reward = task.get(r.problem_id).reward(tok.decode(toks))  # the cheater keeps the reward consistent
        forged.append(resign(r, WORKER, completion_tokens=toks, reward=reward))
    assert set(_rejected(verifier, forged)) <= TAMPER_REASONS


def test_one_prompt_token_changed_is_rejected(verifier: Verifier, engine: TorchEngine,
                                              honest: list[RolloutRecord]) -> None:
    tok = engine.loaded.tokenizer
    task = embedded_task()
    plain, consistent = [], []
    for r in honest[:8]:
        p = list(r.prompt_tokens)
        p[2] = tok.encode(str((int(tok.decode([p[2]])) + 1) % 10))[0]  # a digit of the first operand
        plain.append(resign(r, WORKER, prompt_tokens=p))
        a, b = tok.decode(p)[:-1].split("+")
        other = task.problem(int(a) * 1000 + int(b))  # ... and claim the problem that prompt belongs to
        consistent.append(resign(r, WORKER, prompt_tokens=p, problem_id=other.problem_id,
                                 reward=other.reward(tok.decode(r.completion_tokens))))
    assert set(_rejected(verifier, plain)) == {"prompt_mismatch"}
    assert set(_rejected(verifier, consistent)) <= TAMPER_REASONS


def test_proofs_moved_to_another_rollout_are_rejected(verifier: Verifier,
                                                      honest: list[RolloutRecord]) -> None:
    moved = [resign(a, WORKER, proofs=b.proofs) for a, b in zip(honest[:8], honest[8:16])
             if a.proofs != b.proofs]
    assert moved and set(_rejected(verifier, moved)) == {"toploc"}


def test_truncated_proofs_are_rejected(verifier: Verifier, honest: list[RolloutRecord]) -> None:
    r = honest[0]
    cut = resign(r, WORKER, proofs=[r.proofs[0][:-2]])
    none = msgspec.structs.replace(r, proofs=[])
    assert _rejected(verifier, [cut, sign_rollout(none, WORKER)]) == ["malformed", "malformed"]
    # one bad record does not spoil its batch
    verdicts = verifier.verify([cut, honest[1]])
    assert [v.accepted for v in verdicts] == [False, True]


def test_forged_signatures_are_rejected(verifier: Verifier, honest: list[RolloutRecord]) -> None:
    r = honest[0]
    edited_unsigned = msgspec.structs.replace(r, reward=1.0 - r.reward)
    by_mallory = msgspec.structs.replace(sign_rollout(r, MALLORY), worker=WORKER.peer_id)
    zero = msgspec.structs.replace(r, signature=bytes(64))
    assert _rejected(verifier, [edited_unsigned, by_mallory, zero]) == ["bad_signature"] * 3


def test_tokens_sampled_by_another_model_are_rejected(verifier: Verifier, engine: TorchEngine,
                                                      tmp_path: Path) -> None:
    """The cheater samples with another model, then recomputes proofs and logprobs with the right one:
    TOPLOC and the logprob check pass; only the seeded-sampler check can tell."""
    other = TorchEngine.from_dir(str(random_model(tmp_path / "other", seed=4)))
    recs = rollouts(other, 8, seed=7)
    laundered = []
    states = engine.prefill([(r.prompt_tokens, r.completion_tokens) for r in recs])
    for r, (hidden, logits) in zip(recs, states):
        lp = torch.log_softmax(logits / r.sampling.temperature, -1)
        claimed = lp.gather(-1, torch.tensor(r.completion_tokens).view(-1, 1)).view(-1).tolist()
        laundered.append(resign(r, WORKER, proofs=build_proofs(hidden), logprobs=claimed))
    verdicts = verifier.verify(laundered)
    assert [v.reason for v in verdicts] == ["sampling"] * len(laundered)
    assert all(v.figures["exp_mismatches"] == 0 and v.figures["logprob_diff"] < 1e-4 for v in verdicts)


def test_wrong_policy_version_is_rejected(verifier: Verifier, honest: list[RolloutRecord]) -> None:
    r = honest[0]
    assert _rejected(verifier, [resign(r, WORKER, policy_version=2)]) == ["policy_version"]
    other_cid = checkpoint_cid(embedded_model_dir())[:-1] + "a"
    got = _rejected(verifier, [resign(r, WORKER, checkpoint_cid=other_cid)])
    assert got in (["checkpoint"], ["malformed"])


def test_other_cheap_checks(verifier: Verifier, engine: TorchEngine, honest: list[RolloutRecord]) -> None:
    r = honest[0]
    eos = engine.loaded.tokenizer.eos_id
    cases = {
        "wrong_run": resign(r, WORKER, run_id="other"),
        "dtype": resign(r, WORKER, dtype="bfloat16"),
        "sampling_params": resign(r, WORKER, sampling=msgspec.structs.replace(r.sampling, temperature=0.7)),
        "unknown_task": resign(r, WORKER, problem_id="nope/1"),
        "reward": resign(r, WORKER, reward=1.0 - r.reward),
        "termination": resign(r, WORKER, completion_tokens=[eos, *r.completion_tokens[1:]]),
    }
    got = [v.reason for v in verifier.verify(list(cases.values()))]
    assert got == list(cases)


def test_seeds_are_derived_so_a_worker_cannot_keep_its_luckiest_draws(engine: TorchEngine) -> None:
    from intellect_node.inference.verifier import seed_violation

    # A group of 8: honest generation derives each sample's seed from (run, version, worker, problem, k).
    problem = embedded_task().get("add3/123456")  # 123+456=: sampled right ~1 time in 4
    group = [problem] * 8
    honest = generate_rollouts(engine, engine.loaded.tokenizer, group, key=WORKER, run_id="run",
                               policy_version=3, checkpoint=CID, sampling=SAMPLING)
    assert seed_violation(honest, "run", 3, WORKER.peer_id) == ""
    assert len({r.sampling.seed for r in honest}) == 8
    # The same group again is the same draw: nothing to choose from.
    again = generate_rollouts(engine, engine.loaded.tokenizer, group, key=WORKER, run_id="run",
                              policy_version=3, checkpoint=CID, sampling=SAMPLING)
    assert [r.completion_tokens for r in again] == [r.completion_tokens for r in honest]
    # Best-of-n: sample with seeds of the worker's choosing, keep the rewarded ones. Every other check
    # passes (they are genuine samples of the policy); the seed rule is what rejects them.
    tries = generate_rollouts(engine, engine.loaded.tokenizer, [problem] * 64, key=WORKER, run_id="run",
                              policy_version=3, checkpoint=CID, sampling=SAMPLING, seeds=list(range(1, 65)))
    best = sorted(tries, key=lambda r: -r.reward)[:8]
    assert sum(r.reward for r in best) > sum(r.reward for r in honest)
    assert "is not the derived" in seed_violation(best, "run", 3, WORKER.peer_id)
    # Derived seeds are bound to the worker, version and run: someone else's records do not fit.
    assert seed_violation(honest, "run", 4, WORKER.peer_id)
    assert seed_violation(honest, "run", 3, MALLORY.peer_id)


def test_sampled_tensor_checks_leave_the_cheap_checks_on_every_record(verifier: Verifier, engine: TorchEngine,
                                                                       honest: list[RolloutRecord]) -> None:
    """A validator checking a fraction of a batch's groups (``rl.verify_fraction``) runs the tensor checks
    on those only; the cheap checks still see every record, and there is one verdict per record, in order."""
    tok = engine.loaded.tokenizer
    task = embedded_task()

    def edited(r: RolloutRecord) -> RolloutRecord:  # one token changed, the reward kept consistent
        toks = list(r.completion_tokens)
        i = min(2, len(toks) - 2)
        digit = tok.decode([toks[i]])
        toks[i] = tok.encode(str((int(digit) + 1) % 10) if digit.isdigit() else "7")[0]
        reward = task.get(r.problem_id).reward(tok.decode(toks))
        return resign(r, WORKER, completion_tokens=toks, reward=reward)

    recs = list(honest[:8])
    recs[1], recs[5] = edited(recs[1]), edited(recs[5])
    recs[6] = resign(recs[6], WORKER, reward=1.0 - recs[6].reward)
    sampled = verifier.verify(recs, tensor_checks={0, 1, 2, 3})
    assert [v.rollout_id for v in sampled] == [r.rollout_id for r in recs]
    assert [v.accepted for v in sampled] == [True, False, True, True, True, True, False, True]
    assert sampled[1].reason in TAMPER_REASONS and sampled[6].reason == "reward"
    assert not sampled[5].figures  # accepted on the cheap checks alone: no tensor figures
    full = verifier.verify(recs)
    assert [v.accepted for v in full] == [True, False, True, True, True, False, False, True]
    assert full == verifier.verify(recs, tensor_checks=range(8))


def test_engines_are_made_by_name(engine: TorchEngine) -> None:
    from intellect_node.errors import ConfigError
    from intellect_node.inference import InferenceEngine, make_engine

    problems = embedded_task().sample(random.Random(9), 2)
    made = make_engine(engine.loaded)  # weights in memory: what a role does with each policy version
    assert isinstance(made, InferenceEngine) and made.name == "torch" and made.dtype == "float32"
    from_dir = make_engine(None, "torch")  # the embedded model, loaded from its directory
    for e in (made, from_dir):
        got = generate_rollouts(e, engine.loaded.tokenizer, problems, key=WORKER, run_id="run",
                                policy_version=3, checkpoint=CID, sampling=SAMPLING, seeds=[1, 2])
        want = generate_rollouts(engine, engine.loaded.tokenizer, problems, key=WORKER, run_id="run",
                                 policy_version=3, checkpoint=CID, sampling=SAMPLING, seeds=[1, 2])
        assert [r.completion_tokens for r in got] == [r.completion_tokens for r in want]
    with pytest.raises(ConfigError, match="vLLM engine loads its weights from a model directory"):
        make_engine(engine.loaded, "vllm")
    with pytest.raises(ConfigError, match="engine 'tensorrt' is not one of torch, vllm"):
        make_engine(None, "tensorrt")


def test_a_checker_that_times_out_here_does_not_blame_the_worker(engine: TorchEngine,
                                                                  honest: list[RolloutRecord]) -> None:
    """A slow validator's reward checker can time out on a completion a faster worker scored: that is
    ``reward_unjudged`` (a validator counts it as unchecked), never ``reward``; a checker that answers
    with another score is still ``reward``."""
    from intellect_node.roles.validator.verification import NOT_HELD

    scored = next((r for r in honest if r.reward == 1.0), None) or resign(honest[0], WORKER, reward=1.0)
    th = load_thresholds(engine.loaded.path, "float32")
    slow = Verifier(engine, th, EXPECT, resolve=_judged_as(Judgement(0.0, "timeout")))
    [v] = slow.verify([scored])
    assert (v.accepted, v.reason) == (False, "reward_unjudged") and "reward_unjudged" in NOT_HELD
    wrong = Verifier(engine, th, EXPECT, resolve=_judged_as(Judgement(0.0, "no_answer")))
    [v] = wrong.verify([scored])
    assert (v.accepted, v.reason) == (False, "reward") and "no_answer" in v.detail


def test_slow_answers_past_the_honest_rate_are_held_against_the_batch(engine: TorchEngine,
                                                                      honest: list[RolloutRecord]) -> None:
    """Distinct answers that are slow to score, each claiming reward 1, used to cost the
    whole time limit each and be ``reward_unjudged`` (not held). Under a meter allowing one timeout, the
    first is that; the second makes the batch ``scoring_budget`` (held against the worker), and the rest
    is not scored: real scoring processes, two timeouts and no third call."""
    from intellect_node.roles.validator.verification import NOT_HELD

    tok = engine.loaded.tokenizer
    slow = [f"9^{{9^{{9^{{{d}}}}}}}" for d in (8, 7, 6, 5)]  # 9^{9^{9^{8}}}: sympy never finishes
    forged = [resign(r, WORKER, completion_tokens=(toks := tok.encode(text) + [min(tok.eos_ids)]),
                     logprobs=[-1.0] * len(toks), reward=1.0)
              for r, text in zip(honest, slow)]

    th = load_thresholds(engine.loaded.path, "float32")
    pool = ScoringPool(1)
    meter = Meter(seconds=60.0, timeouts=1)
    try:
        verdicts = Verifier(engine, th, EXPECT, resolve=_math_problem(1.0)).verify(
            forged, scoring=Lane(pool, meter))
    finally:
        pool.close()
    assert [v.reason for v in verdicts] == ["reward_unjudged"] + ["scoring_budget"] * 3
    assert "scoring_budget" not in NOT_HELD and "2 answers ran past the time limit" in verdicts[1].detail
    assert (meter.calls, meter.timed_out, pool.killed) == (2, 2, 2)


def test_a_batch_past_its_scoring_seconds_is_not_scored_further(engine: TorchEngine,
                                                                honest: list[RolloutRecord]) -> None:
    """Scoring time is charged too: under a meter with no seconds left nothing is scored, whatever the
    claim."""
    th = load_thresholds(engine.loaded.path, "float32")
    pool = ScoringPool(1)
    try:
        verdicts = Verifier(engine, th, EXPECT, resolve=_math_problem(5.0)).verify(
            honest[:3], scoring=Lane(pool, Meter(0.0, 1)))
    finally:
        pool.close()
    assert [v.reason for v in verdicts] == ["scoring_budget"] * 3 and pool.started == 0


def _math_problem(timeout_s: float) -> Callable[[str], Problem]:
    """The embedded problem, scored by math-verify against "4" in a scoring process."""
    from intellect_node.envs.scoring import DEFAULT_EXTRACTION, Scorer

    def problem(pid: str) -> Problem:
        check = Scorer(DEFAULT_EXTRACTION, lambda answer: check_math(answer, "4", timeout_s=timeout_s))
        return dataclasses.replace(resolve_problem(pid), scorer=check)

    return problem


def _judged_as(judgement: Judgement) -> Callable[[str], Problem]:
    return lambda pid: dataclasses.replace(resolve_problem(pid), scorer=lambda text: judgement)


EXPECT = Expectations(run_id="run", policy_version=3, checkpoint_cid=CID, temperature=1.0, top_p=1.0,
                      max_new_tokens=16)
