"""Tasks with a verifiable reward: a prompt, a reference answer and a checker that scores a completion.

A *task* is a family of problems (``task_id``, e.g. ``"add3"``); a *problem* is one instance of it with a
stable ``problem_id``, the prompt text, the reference answer and the name of the checker that compares a
completion with the answer. Rewards are computed from text only, so a worker, a validator and the trainer
all score a rollout the same way.

The embedded task is fixed-width 3-digit addition: prompt ``"123+045="``, answer ``"0168"``. Its problems
are indexed 0..999_999 (``a = index // 1000``, ``b = index % 1000``) so any node can rebuild a problem from
its ID without a dataset file. Other tasks (a JSONL file, a reasoning-gym dataset:
``intellect_node.envs``) implement the same :class:`Task` protocol, and either name a checker in
:data:`CHECKERS` or give each problem its own ``scorer`` (answer extraction and a dataset's checker, run
under a time limit).

:meth:`Problem.reward` is the one entry point every role calls (the worker when it scores a rollout, the
validator when it re-scores one, the trainer when it builds samples). Completions are hostile input: a
reward is always a float in [0, 1], and :meth:`Problem.judge` says why a completion got 0 when no answer
could be scored (too long, no answer found, the checker timed out or failed).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from intellect_node.envs.sandbox import ScoringFailed
from intellect_node.errors import ConfigError

MAX_COMPLETION_CHARS = 32_768
"""Completions longer than this score 0 (``too_long``) before any checker sees them: a bound on the work
a hostile completion can cause. The default of ``rl.max_completion_chars``; far above what the embedded
task's 8 new tokens can produce."""


@dataclass(frozen=True)
class Judgement:
    """A completion's reward and, when it is 0 for want of a scorable answer, why."""

    reward: float
    reason: str = ""
    """"" when the checker scored an answer; else e.g. ``too_long``, ``no_answer``, ``unclosed_think``,
    ``timeout``, ``checker_error``, ``budget`` (not scored: the scoring meter of the caller's lane is
    spent, ``envs/sandbox.py``)."""


def check_exact(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def check_integer(completion: str, answer: str) -> float:
    """1.0 when both parse as the same integer (leading zeros and whitespace ignored); else 0.0."""
    try:
        return 1.0 if int(completion.strip()) == int(answer.strip()) else 0.0
    except ValueError:
        return 0.0


def check_math(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equal to ``answer`` (LaTeX, ``\\boxed{}``,
    fractions, ``0.5 == 1/2``); run in a scoring process under a time limit (``intellect_node.envs``)."""
    from intellect_node.envs.mathcheck import check_math as run

    return run(completion, answer)


CHECKERS: dict[str, Callable[[str, str], float]] = {"exact": check_exact, "integer": check_integer,
                                                    "math": check_math}
"""Checker kinds by name. A problem names its checker, so the reward rule travels with the problem."""


@dataclass(frozen=True)
class Problem:
    """One instance of a task."""

    task_id: str
    problem_id: str
    prompt: str
    answer: str
    checker: str = "exact"
    system: str = ""
    """System prompt the chat template renders before ``prompt`` (empty: none); part of the run's task
    settings, so every node renders the same prompt tokens."""
    scorer: Callable[[str], Judgement] | None = field(default=None, compare=False, repr=False)
    """Scores a completion in place of ``checker`` (an environment's extraction and its dataset's own
    checker). Left out of equality: two nodes' problems are the same when their IDs, prompts and answers
    are, and the settings that shape scoring are hashed into the task ID."""

    def reward(self, completion: str) -> float:
        """The reward of ``completion``: a float in [0, 1] for any text (see :meth:`judge`)."""
        return self.judge(completion).reward

    def judge(self, completion: str) -> Judgement:
        """The reward and, when no answer could be scored, the reason. Never raises on a completion:
        a worker's text is hostile input and one bad rollout must not stop a validator or the trainer."""
        if self.scorer is not None:
            return self.scorer(completion)
        try:
            check = CHECKERS[self.checker]
        except KeyError:
            raise ConfigError(f"unknown checker {self.checker!r} for task {self.task_id!r}; "
                              f"known: {sorted(CHECKERS)}", field="checker") from None
        if len(completion) > MAX_COMPLETION_CHARS:
            return Judgement(0.0, "too_long")
        try:
            return bounded(check(completion, self.answer))
        except ScoringFailed as exc:
            return Judgement(0.0, exc.reason)


def bounded(score: float) -> Judgement:
    """``score`` as a judgement, refusing what a checker must not return (NaN, outside [0, 1])."""
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score) \
            or not 0.0 <= score <= 1.0:
        return Judgement(0.0, "bad_score")
    return Judgement(float(score))


def problem_index(task_id: str, problem_id: str) -> int:
    """The index in ``<task_id>/<index>``; ConfigError for any other form. Canonical decimal only:
    "add3/01" and "add3/1" naming one problem would give a worker two sets of derived sampling seeds for
    it (proofs.sampling keys seeds by problem ID)."""
    prefix = task_id + "/"
    tail = problem_id[len(prefix):] if problem_id.startswith(prefix) else ""
    if not tail.isascii() or not tail.isdigit() or len(tail) > 12 or str(int(tail)) != tail:
        raise ConfigError(f"{problem_id!r} is not a problem of task {task_id!r}", field="problem_id")
    return int(tail)


@runtime_checkable
class Task(Protocol):
    """A family of problems that can be enumerated, sampled and looked up by problem ID."""

    task_id: str

    def __len__(self) -> int: ...

    def problem(self, index: int) -> Problem: ...

    def get(self, problem_id: str) -> Problem:
        """The problem named ``problem_id``; ConfigError (unknown id) if this task has none."""
        ...

    def sample(self, rng: random.Random, n: int) -> list[Problem]: ...


class AdditionTask:
    """``"abc+def="`` -> the 4-digit zero-padded sum. 10^6 problems, addressable by index or ID."""

    def __init__(self, digits: int = 3, task_id: str | None = None) -> None:
        if not 1 <= digits <= 9:
            raise ConfigError(f"addition digits must be 1..9, got {digits}", field="digits")
        self.digits = digits
        self.task_id = task_id or f"add{digits}"
        self._base: int = 10 ** digits

    def __len__(self) -> int:
        return self._base * self._base

    def problem(self, index: int) -> Problem:
        if not 0 <= index < len(self):
            raise ConfigError(f"problem index {index} out of range 0..{len(self) - 1}", field="index")
        a, b = divmod(index, self._base)
        d = self.digits
        return Problem(task_id=self.task_id, problem_id=f"{self.task_id}/{index}",
                       prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=f"{a + b:0{d + 1}d}", checker="exact")

    def get(self, problem_id: str) -> Problem:
        return self.problem(problem_index(self.task_id, problem_id))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problem(rng.randrange(len(self))) for _ in range(n)]


EMBEDDED_TASK_ID = "add3"


def embedded_task() -> AdditionTask:
    """The task the embedded model was pretrained on (and that RL improves)."""
    return AdditionTask(3)


_REGISTRY: dict[str, Callable[[], Task]] = {EMBEDDED_TASK_ID: embedded_task}


def register_task(task_id: str, factory: Callable[[], Task]) -> None:
    """Make a task resolvable by ID (e.g. a JSONL loader registers each file it loads)."""
    _REGISTRY[task_id] = factory


def get_task(task_id: str) -> Task:
    try:
        return _REGISTRY[task_id]()
    except KeyError:
        raise ConfigError(f"unknown task {task_id!r}; known: {sorted(_REGISTRY)}", field="task") from None


def resolve_problem(problem_id: str) -> Problem:
    """Find a problem from its ID ``<task_id>/<index>`` across the registered tasks."""
    task_id = problem_id.rsplit("/", 1)[0]
    return get_task(task_id).get(problem_id)
