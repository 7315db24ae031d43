"""The run's task built from the configuration, under an environment's settings (:mod:`.scoring`).

``EnvSettings`` holds what decides a reward and a prompt besides the problem itself: the answer
extraction (:mod:`.extract`), the system prompt, and the scorer's time limit. Everything but the time
limit is hashed (:meth:`EnvSettings.digest`) into the task ID, ``<task>@<hash>``, so problem IDs carry
the settings: a validator or trainer configured differently from a worker cannot resolve the worker's
problem IDs (``unknown_task``) instead of silently scoring the same text another way. The embedded task
and task files keep their plain IDs while every hashed setting is at its default, so runs configured
before environments existed are unchanged.

The time limit stays out of the hash: validators on slow machines may give the checker more time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Mapping

from intellect_node.envs import reasoning_gym as rg
from intellect_node.envs.extract import Extraction
from intellect_node.envs.sandbox import DEFAULT_TIMEOUT_S
from intellect_node.envs.scoring import DEFAULT_EXTRACTION, EnvSettings, Memo, Scorer
from intellect_node.envs.tasks import (
    CHECKERS,
    MAX_COMPLETION_CHARS,
    Problem,
    Task,
)
from intellect_node.errors import ConfigError


@dataclass(frozen=True)
class _CheckerOf:
    """``CHECKERS[name](answer, reference)``, with the settings' time limit for the ``math`` checker."""

    name: str
    reference: str
    timeout_s: float

    def __call__(self, answer: str) -> float:
        if self.name == "math":
            from intellect_node.envs.mathcheck import check_math

            return check_math(answer, self.reference, timeout_s=self.timeout_s)
        return CHECKERS[self.name](answer, self.reference)


@dataclass
class SettledTask:
    """A task file or the embedded task under non-default environment settings: the same problems,
    scored through the settings' extraction, with the system prompt, under ``<task_id>@<hash>`` when a
    hashed setting differs from the default (implements the ``Task`` protocol)."""

    base: Task
    settings: EnvSettings
    task_id: str = field(init=False)
    memo: Memo = field(init=False, default_factory=Memo)

    def __post_init__(self) -> None:
        default = EnvSettings()
        hashed = self.settings.canonical() != default.canonical()
        sha = getattr(self.base, "sha256", "")
        self.task_id = (f"{self.base.task_id}@{self.settings.digest(task=self.base.task_id, sha256=sha)}"
                        if hashed else self.base.task_id)

    def __len__(self) -> int:
        return len(self.base)

    def _settle(self, p: Problem) -> Problem:
        index = p.problem_id.rsplit("/", 1)[1]
        pid = f"{self.task_id}/{index}"
        scorer = Scorer(self.settings.extraction, _CheckerOf(p.checker, p.answer, self.settings.timeout_s),
                        pid, self.memo)
        return replace(p, task_id=self.task_id, problem_id=pid, system=self.settings.system or p.system,
                       scorer=scorer)

    def problem(self, index: int) -> Problem:
        return self._settle(self.base.problem(index))

    def get(self, problem_id: str) -> Problem:
        prefix = self.task_id + "/"
        if not problem_id.startswith(prefix):
            raise ConfigError(f"{problem_id!r} is not a problem of task {self.task_id!r}", field="problem_id")
        return self._settle(self.base.get(self.base.task_id + "/" + problem_id[len(prefix):]))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self._settle(p) for p in self.base.sample(rng, n)]


SLOW_CHECKERS = frozenset({"math"})
"""Checkers that run in a scoring process under a time limit: a task naming one is always scored through
a :class:`Scorer` and its memo, so a hostile completion repeated across a batch pays the limit once."""


def settle(task: Task, settings: EnvSettings) -> Task:
    """``task`` as is under the default settings when its checkers are cheap, else wrapped in
    :class:`SettledTask` (the same task ID under the default settings: nothing hashed differs)."""
    slow = SLOW_CHECKERS & frozenset(getattr(task, "checkers", ()))
    if settings == EnvSettings() and not slow:
        return task
    return SettledTask(task, settings)


def build_task(*, task: str = "add3", tasks_file: str | None = None, env: str | None = None,
               env_args: Mapping[str, object] | None = None, answer_format: str = "auto", think: str = "auto",
               max_completion_chars: int = MAX_COMPLETION_CHARS, system_prompt: str | None = None,
               reward_timeout_s: float = DEFAULT_TIMEOUT_S) -> Task:
    """The run's task from the ``[rl]`` settings, registered so its problem IDs resolve
    (``envs.tasks.resolve_problem``, what the verifier uses). ``auto`` means the environment's own
    default: answer tags after stripped reasoning for reasoning-gym, the whole text for task files and
    the embedded task; an unset system prompt means reasoning-gym's instruction where it has one."""
    from intellect_node.envs.tasks import get_task, register_task

    if env is not None and tasks_file is not None:
        raise ConfigError("rl.env and rl.tasks_file are both set; a run has one task source: drop one",
                          field="rl.env")
    if env_args and env is None:
        raise ConfigError("rl.env_args is set but rl.env is not; env_args configure a reasoning_gym "
                          "dataset", field="rl.env_args")
    if env is not None:
        dataset = rg.parse_env(env)
        if task not in ("add3", env):
            raise ConfigError(f"rl.task {task!r} and rl.env {env!r} are both set; drop rl.task",
                              field="rl.task")
        base_mode, base_think, base_system = (rg.DEFAULT_EXTRACTION.mode, rg.DEFAULT_EXTRACTION.think,
                                              rg.DEFAULT_SYSTEM_PROMPT)
    else:
        base_mode, base_think, base_system = DEFAULT_EXTRACTION.mode, DEFAULT_EXTRACTION.think, ""
    # The operator's strings are checked by Extraction itself (its __post_init__ names the field).
    extraction = Extraction(mode=base_mode if answer_format == "auto" else answer_format,  # type: ignore[arg-type]
                            think=base_think if think == "auto" else think,  # type: ignore[arg-type]
                            max_chars=max_completion_chars)
    settings = EnvSettings(extraction=extraction,
                           system=base_system if system_prompt is None else system_prompt,
                           timeout_s=reward_timeout_s)
    built: Task
    if env is not None:
        built = rg.ReasoningGymTask(dataset, env_args, settings)
    elif tasks_file is not None:
        from intellect_node.envs.jsonl_tasks import load_jsonl_tasks

        base = load_jsonl_tasks(tasks_file)
        if task not in ("add3", base.task_id):
            raise ConfigError(f"rl.task {task!r} differs from the task file's ID {base.task_id!r}; "
                              "drop rl.task or rename the file", field="rl.task")
        built = settle(base, settings)
    else:
        built = settle(get_task(task), settings)
    register_task(built.task_id, lambda: built)
    return built
