"""Tasks with a verifiable reward: a prompt, a reference answer and a checker that scores a completion.

A *task* is a family of problems (``task_id``, e.g. ``"add3"``); a *problem* is one instance of it with a
stable ``problem_id``, the prompt text, the reference answer and the name of the checker that compares a
completion with the answer. Rewards are computed from text only, so a worker, a validator and the trainer
all score a rollout the same way.

The embedded task is fixed-width 3-digit addition: prompt ``"123+045="``, answer ``"0168"``. Its problems
are indexed 0..999_999 (``a = index // 1000``, ``b = index % 1000``) so any node can rebuild a problem from
its ID without a dataset file. Other tasks (e.g. a JSONL loader) implement the same :class:`Task`
protocol and register a checker name in :data:`CHECKERS`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from intellect_node.errors import ConfigError


def check_exact(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def check_integer(completion: str, answer: str) -> float:
    """1.0 when both parse as the same integer (leading zeros and whitespace ignored); else 0.0."""
    try:
        return 1.0 if int(completion.strip()) == int(answer.strip()) else 0.0
    except ValueError:
        return 0.0


CHECKERS: dict[str, Callable[[str, str], float]] = {"exact": check_exact, "integer": check_integer}
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

    def reward(self, completion: str) -> float:
        try:
            check = CHECKERS[self.checker]
        except KeyError:
            raise ConfigError(f"unknown checker {self.checker!r} for task {self.task_id!r}; "
                              f"known: {sorted(CHECKERS)}", field="checker") from None
        return check(completion, self.answer)


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
        self._base = 10 ** digits

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
        prefix = self.task_id + "/"
        tail = problem_id[len(prefix):] if problem_id.startswith(prefix) else ""
        if not tail.isdigit() or len(tail) > 12:
            raise ConfigError(f"{problem_id!r} is not a problem of task {self.task_id!r}", field="problem_id")
        return self.problem(int(tail))

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
