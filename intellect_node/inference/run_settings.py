"""Settings that fit the model and the task, and a preflight that says whether a run can learn.

The defaults of ``[rl]`` are the embedded model's: 5 new tokens (a 3-digit sum and ``<eos>``), lr 2e-4, and
reasoning-gym's answer tags. A pretrained model given those settings earns reward 0 on every rollout (it
never writes the tags in 5 tokens), every group is filtered out, and the trainer never steps. What
:func:`fit_settings` does for any model but the embedded one:

1. No task chosen (``rl.task`` is the embedded ``add3``, no ``rl.env``, no ``rl.tasks_file``): the task
   becomes reasoning-gym's ``basic_arithmetic`` at a size the model can start on (below 1B parameters:
   sums of two 1-digit numbers). The embedded task's prompts are written for the embedded character model.
2. The answer format: below 1B parameters, or without a chat template, ``whole``: the whole completion is
   the answer, and reasoning-gym's partial credit (``"5"`` 1.0, ``"5."`` 0.5, ``"4 + 1 = 5"`` 0.11) gives a
   signal toward short exact answers; small instruct models do not follow the answer-tag instruction.
   Larger models keep the environment's own format (answer tags after reasoning).
3. The system prompt that matches the format ("Answer with the number only." for arithmetic datasets).
4. ``max_new_tokens``: room for the answer and a little text (16 for arithmetic with ``whole``, 32 for
   other datasets, 256 for reasoning with answer tags).
5. The learning rate by size: :data:`LR_BY_SIZE`.
6. Above 50M parameters: ``groups_per_step`` 4, so a CPU step stays within about half a minute,
   ``work_ahead`` 1, so rollouts are at most one version old (a pretrained model moves further per step
   at these rates than the embedded one, whose demo works two versions ahead), and ``target_kl``
   (:data:`TARGET_KL`), so the step shrinks until a stale batch is inside the trust region.

Whatever the operator gave (a flag, ``--config``) is kept, and reported as given. The embedded model gets
no choices: the defaults are its settings.

:func:`preflight` generates groups for a sample of the run's problems with the starting policy and the
run's settings, and says whether any group has unequal rewards (the only groups GRPO learns from).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from intellect_node.envs.tasks import Problem
    from intellect_node.inference.base import LoadedEngine

LR_BY_SIZE: tuple[tuple[float, float, str], ...] = (
    (10e6, 2e-4, "the embedded model's rate (bench/learning.py)"),
    (300e6, 5e-5, "SmolLM2-135M's held-out pass rate rose 0 -> 0.25 in 30 minutes in the swarm at this "
                  "rate (bench/README.md, \"Real-model learning\")"),
    (3e9, 2e-6, "between the small-model rate and INTELLECT-2's"),
    (float("inf"), 3e-7, "INTELLECT-2's rate for QwQ-32B (arXiv 2505.07291)"),
)
"""(parameters below, learning rate, source), first match wins."""

TARGET_KL = 0.01
"""``rl.target_kl`` chosen above 50M parameters: SmolLM2-135M's first one-version-stale step at lr 5e-5
measured 0.25 nats/token to its sampler, with 32% of its tokens clipped (bench/README.md, "Real-model
learning"); the target-KL step brings the lr down to where stale batches stay inside the region and
keeps it on on-policy steps."""

SMALL_MODEL = 1e9
"""Below this many parameters a model gets the whole-text answer format and short completions."""

ARITHMETIC = frozenset({"basic_arithmetic", "chain_sum", "products", "decimal_arithmetic",
                        "fraction_simplification", "gcd", "lcm", "leg_counting", "count_bits",
                        "power_function", "prime_factorization", "number_sorting"})
"""reasoning-gym datasets whose answer is a number or a short list of numbers."""

SMALL_ARITHMETIC_ARGS: dict[str, object] = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                            "operators": ["+"], "allow_parentheses": False,
                                            "allow_negation": False}
"""basic_arithmetic at the size a 135M instruct model starts on: sums of two 1-digit numbers (its solve rate
there is a few percent with the bare-number format, enough for groups with unequal rewards)."""

DEFAULT_ENV = "reasoning_gym:basic_arithmetic"


@dataclass(frozen=True)
class Choice:
    """One ``[rl]`` setting: its value and why (``given`` when the operator set it)."""

    key: str
    value: object
    why: str
    given: bool = False

    def line(self) -> str:
        mark = "given" if self.given else "chosen"
        return f"  rl.{self.key} = {self.value!r} ({mark}: {self.why})"


@dataclass(frozen=True)
class ModelFacts:
    """What the settings depend on: the size, whether prompts go through a chat template, the embedded
    model or not."""

    n_params: int
    chat_template: bool
    embedded: bool
    name: str = ""


def model_facts(model_dir: Path) -> ModelFacts:
    from intellect_node.inference.memory import model_shape
    from intellect_node.models.loader import embedded_model_dir
    from intellect_node.models.tokenizer import ModelTokenizer

    embedded = model_dir.resolve() == embedded_model_dir().resolve()
    return ModelFacts(n_params=model_shape(model_dir).n_params,
                      chat_template=ModelTokenizer(model_dir).chat_template is not None,
                      embedded=embedded, name=model_dir.name)


def size_text(n: int) -> str:
    """``135M``, ``0.3M``, ``1.7B``."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 10e6 else f"{n / 1e6:.1f}M"


def _dataset(env: str | None) -> str:
    return env.split(":", 1)[1] if env and ":" in env else ""


def fit_settings(facts: ModelFacts, given: Mapping[str, object]) -> list[Choice]:
    """The ``[rl]`` settings for ``facts``'s model: every choice of the module docstring, with ``given``
    (the ``[rl]`` fields the operator set) kept and reported as given. Pure: no files, no model."""
    if facts.embedded:
        return [Choice(k, v, "set by the operator", True) for k, v in sorted(given.items())]
    out: dict[str, Choice] = {k: Choice(k, v, "set by the operator", True) for k, v in given.items()}
    size = size_text(facts.n_params)
    small = facts.n_params < SMALL_MODEL or not facts.chat_template

    def choose(key: str, value: object, why: str) -> None:
        out.setdefault(key, Choice(key, value, why))

    has_task = any(k in given for k in ("env", "tasks_file")) or given.get("task", "add3") != "add3"
    if not has_task:
        choose("env", DEFAULT_ENV, "no task given; the embedded task is written for the embedded model")
        if small:
            choose("env_args", dict(SMALL_ARITHMETIC_ARGS),
                   f"sums of two 1-digit numbers: a {size} model solves a few, so groups differ in reward")
    env = out["env"].value if "env" in out else None
    arithmetic = _dataset(env if isinstance(env, str) else None) in ARITHMETIC
    if small:
        why = (f"a {size} model rarely writes the answer tags; the whole text is scored, with "
               "reasoning-gym's partial credit for short exact answers") if facts.chat_template else \
            "no chat template: the model cannot be told where the answer goes"
        choose("answer_format", "whole", why)
    whole = out.get("answer_format", Choice("", "auto", "")).value == "whole"
    if whole and facts.chat_template:
        choose("system_prompt", "Answer with the number only." if arithmetic else
               "Answer with the final answer only, nothing else.",
               "tells the model the format it is scored on")
    if whole:
        choose("max_new_tokens", 16 if arithmetic else 32, "room for a short answer; longer completions "
               "only cost time when the whole text is the answer")
    else:
        choose("max_new_tokens", 256, "room to reason before the tagged answer")
    for below, lr, source in LR_BY_SIZE:
        if facts.n_params < below:
            choose("lr", lr, f"a {size} model: {source}")
            break
    if facts.n_params > 50e6:
        choose("groups_per_step", 4, f"a {size} model steps in about half a minute on a CPU with 4 groups")
        choose("work_ahead", 1, "rollouts at most one version old: each step moves the policy further "
               "than the embedded model's")
        choose("target_kl", TARGET_KL, "the step scaled toward this KL to the sampler per token: at a fixed "
               "lr a batch one version old is already far outside the trust region (docs/training.md)")
    return sorted(out.values(), key=lambda c: c.key)


def apply(choices: Sequence[Choice]) -> dict[str, Any]:
    """The ``[rl]`` values of ``choices``."""
    return {c.key: c.value for c in choices}


@dataclass(frozen=True)
class Preflight:
    """The starting policy on a sample of the run's problems, sampled as the run samples."""

    groups: int
    learnable: int
    """Groups whose rewards are not all equal: the only groups GRPO learns from."""
    all_zero: int
    all_max: int
    mean_reward: float
    pass_rate: float
    """Fraction of samples with reward 1."""
    examples: list[tuple[str, str, float]] = field(default_factory=list)
    """(expected answer, completion, reward) of a few samples."""

    def ok(self) -> bool:
        return self.learnable > 0

    def summary(self) -> str:
        head = (f"preflight: {self.learnable}/{self.groups} groups learnable, mean reward "
                f"{self.mean_reward:.3f}, pass rate {self.pass_rate:.3f}")
        if self.ok():
            return head
        if self.all_zero == self.groups:
            why = ("every reward is 0: the completions do not reach the answer (raise rl.max_new_tokens), "
                   "the model does not write the answer format (rl.answer_format, rl.system_prompt), or the "
                   "task is too hard for it (rl.env_args)")
        elif self.all_max == self.groups:
            why = "every reward is 1: the task is too easy for the model (raise its difficulty, rl.env_args)"
        else:
            why = "the rewards of each group are equal: raise rl.temperature or rl.group_size"
        return f"{head}\nWARNING: nothing is learnable with these settings: {why}"


def preflight(engine: LoadedEngine, problems: Sequence[Problem], *, group_size: int, max_new_tokens: int,
              temperature: float = 1.0, seed: int = 0, batch: int = 64) -> Preflight:
    """Sample ``group_size`` completions of each problem with ``engine`` and the run's sampling, score
    them with the problem's own checker, and count the learnable groups."""
    from intellect_node.inference.base import SamplingConfig
    from intellect_node.proofs.sampling import rollout_key

    tok = engine.loaded.tokenizer
    sampling = SamplingConfig(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    rng = random.Random(seed)
    flat = [p for p in problems for _ in range(group_size)]
    texts: list[str] = []
    for start in range(0, len(flat), batch):
        chunk = flat[start:start + batch]
        keys = [rollout_key(rng.getrandbits(63), f"preflight-{start + i}") for i in range(len(chunk))]
        gens = engine.generate([tok.prompt_ids(p.prompt, system=p.system or None) for p in chunk], keys,
                               sampling)
        texts += [tok.decode(g.tokens) for g in gens]
    rewards = [p.reward(t) for p, t in zip(flat, texts)]
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    top = 1.0
    examples = [(flat[i].answer, texts[i], rewards[i]) for i in range(0, len(flat), group_size)][:4]
    return Preflight(groups=len(groups), learnable=sum(1 for g in groups if max(g) != min(g)),
                     all_zero=sum(1 for g in groups if max(g) == 0.0),
                     all_max=sum(1 for g in groups if min(g) >= top),
                     mean_reward=sum(rewards) / max(1, len(rewards)),
                     pass_rate=sum(1 for r in rewards if r >= top) / max(1, len(rewards)),
                     examples=examples)
