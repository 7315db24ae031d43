"""Measuring a policy with the engine: held-out pass rate and mean reward, and per-problem solve rates
(offline filter).

The pass rate a trainer logs per step is measured on that step's 32-64 rollouts and swings by +-0.2
from step to step; to tell whether a run learned, compare policies on the *same* problems with the
*same* sampler keys (temperature 1, the rollouts' sampler). With 512 problems the standard error is
about 0.02, and two evaluations of one policy agree exactly.

A policy is a model folder (Hugging Face layout) plus, optionally, a weights file that replaces its
weights: a trainer checkpoint (``trainer/checkpoints/vNNN/model.safetensors``) or a published policy
checkpoint. Shortcut: problems are drawn from the task with a seeded RNG, so "held out" means "not
chosen for this purpose", not disjoint from training problems (a 10^6-problem task makes overlap rare).
For a reward environment, :func:`held_out` evaluates problems ``0..n-1`` of a task built with its own
generator seed (``env_args.seed``): distinct seeds from a run's, though a small problem space (sums of
two digits) still repeats questions. A run's own evaluation (``run.eval_every``) is on problems held out
of its training by construction (``envs/heldout.py``), generated in fixed chunks (:func:`chunk_rewards`)
so any node can check any chunk again.

Environments give partial credit (reasoning-gym's ``basic_arithmetic`` scores "5." 0.5 against "5"), so
an :class:`Evaluation` keeps every reward: ``mean_reward``, and ``pass_rate``, the share with full credit.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from intellect_node.envs.filtering import measure_solve_rates
from intellect_node.envs.tasks import Judgement, Problem, Task, embedded_task
from intellect_node.errors import ConfigError
from intellect_node.inference.base import LoadedEngine, SamplingConfig
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.models.loader import LoadedModel, load_model, torch_dtype
from intellect_node.proofs.sampling import rollout_key

EVAL_SEED = 20261129
"""Default seed of the problem set and sampler keys: the same seed always gives the same evaluation."""


def with_weights(base: LoadedModel, weights: str | Path) -> LoadedModel:
    """``base`` (config, tokenizer, dtype) with the tensors of a safetensors file."""
    from safetensors.torch import load_file

    path = Path(weights)
    if not path.is_file():
        raise ConfigError(f"--weights: {path} is not a file (expected a .safetensors checkpoint)",
                          field="weights")
    state = load_file(str(path))
    missing = set(base.state) - set(state)
    if missing:
        raise ConfigError(f"--weights: {path} lacks tensors of the model, e.g. {sorted(missing)[:3]}",
                          field="weights")
    dt = torch_dtype(base.dtype)
    return dataclasses.replace(base, state={k: state[k].to(dtype=dt) for k in base.state})


@dataclass(frozen=True)
class Evaluation:
    """One sampled completion's reward per problem, in the problems' order."""

    rewards: tuple[float, ...]

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    @property
    def pass_rate(self) -> float:
        """Share of problems with full credit (reward 1)."""
        return sum(r >= 1.0 for r in self.rewards) / len(self.rewards)


def _rewards(model: LoadedModel, problems: Sequence[Problem], keys: Sequence[int],
             sampling: SamplingConfig, batch: int) -> Evaluation:
    engine = TorchEngine(model)
    tok = model.tokenizer
    rewards: list[float] = []
    with torch.inference_mode():
        for i in range(0, len(problems), batch):
            chunk = problems[i:i + batch]
            gens = engine.generate([tok.prompt_ids(p.prompt, system=p.system or None) for p in chunk],
                                   list(keys[i:i + batch]), sampling)
            rewards += [p.reward(tok.decode(g.tokens)) for p, g in zip(chunk, gens)]
    return Evaluation(tuple(rewards))


def held_out_keys(seed: int, n: int) -> list[int]:
    """The sampler keys of held-out problems ``0..n-1`` under ``seed``: key ``i`` is the same for every
    ``n`` above ``i``, so a subset is evaluated under the keys of the whole."""
    rng = random.Random(seed)
    return [rollout_key(rng.getrandbits(63), f"held-out-{i}") for i in range(n)]


EVAL_CHUNK = 8
"""Held-out problems generated together in a run's evaluation (``chunk_rewards``): chunk ``c`` is problems
``8c..8c+7``, always one batch, so a node checking a chunk again runs the very batch (the same padding
and shapes, so the same arithmetic) the evaluator ran."""


def chunk_rewards(engine: LoadedEngine, problems: Sequence[Problem], keys: Sequence[int],
                  sampling: SamplingConfig, chunks: Sequence[int]) -> dict[int, Judgement]:
    """The judgements of the problems in ``chunks`` (of :data:`EVAL_CHUNK` problems each, by index), one
    completion each under its key: problem index -> reward and, for a 0 not scored, why."""
    tok = engine.loaded.tokenizer
    out: dict[int, Judgement] = {}
    with torch.inference_mode():
        for c in chunks:
            idx = list(range(c * EVAL_CHUNK, min((c + 1) * EVAL_CHUNK, len(problems))))
            chunk = [problems[i] for i in idx]
            gens = engine.generate([tok.prompt_ids(p.prompt, system=p.system or None) for p in chunk],
                                   [keys[i] for i in idx], sampling)
            out.update((i, p.judge(tok.decode(g.tokens))) for i, p, g in zip(idx, chunk, gens))
    return out


def held_out(model: LoadedModel, task: Task, *, n: int = 256, seed: int = EVAL_SEED,
             max_new_tokens: int = 16, temperature: float = 1.0, batch: int = 64) -> Evaluation:
    """Rewards of problems ``0..n-1`` of ``task`` (built from held-out settings: another generator
    seed), one completion each under sampler keys fixed by ``seed``: the same policy gives the same
    figures, and two policies are compared on the same problems and noise."""
    if not 1 <= n <= len(task):
        raise ConfigError(f"--n {n}: the held-out task has {len(task)} problems", field="n")
    problems = [task.problem(i) for i in range(n)]
    keys = held_out_keys(seed, n)
    sampling = SamplingConfig(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    return _rewards(model, problems, keys, sampling, batch)


def pass_rate(model: LoadedModel, *, task: Task | None = None, n: int = 512, seed: int = EVAL_SEED,
              max_new_tokens: int = 5, temperature: float = 1.0, batch: int = 128) -> float:
    """Mean reward of ``n`` problems drawn from ``task`` (default: the embedded one, whose rewards are
    0 or 1, so this is its pass rate) with a seeded RNG, one sampled completion each."""
    if n < 1:
        raise ConfigError("--n must be at least 1", field="n")
    task = task or embedded_task()
    rng = random.Random(seed)
    problems = task.sample(rng, n)
    keys = [rollout_key(rng.getrandbits(63), f"eval-{i}") for i in range(n)]
    sampling = SamplingConfig(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    return _rewards(model, problems, keys, sampling, batch).mean_reward


def evaluate(model: str | Path | None = None, weights: str | Path | None = None, *, n: int = 512,
             seed: int = EVAL_SEED, max_new_tokens: int = 5) -> float:
    """:func:`pass_rate` of a model folder (default: embedded), optionally with other weights."""
    base = load_model(model)
    return pass_rate(with_weights(base, weights) if weights is not None else base, n=n, seed=seed,
                     max_new_tokens=max_new_tokens)


def solve_rates(engine: LoadedEngine, problems: Sequence[Problem], samples: int, *, max_new_tokens: int,
                temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Solve rates of ``problems`` under ``engine`` (the starting policy), ``samples`` draws each."""
    tok = engine.loaded.tokenizer
    sampling = SamplingConfig(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    rng = random.Random(seed)

    def rewards(chunk: Sequence[Problem], n: int) -> list[list[float]]:
        flat = [p for p in chunk for _ in range(n)]
        keys = [rollout_key(rng.getrandbits(63), f"solve-rate-{i}") for i in range(len(flat))]
        gens = engine.generate([tok.prompt_ids(p.prompt, system=p.system or None) for p in flat], keys,
                               sampling)
        scores = [p.reward(tok.decode(g.tokens)) for p, g in zip(flat, gens)]
        return [scores[i * n:(i + 1) * n] for i in range(len(chunk))]

    return measure_solve_rates(problems, rewards, samples, batch=max(1, 256 // samples))
