"""Which problems are worth training on: the offline filter.

Before the run, as INTELLECT-2 did: sample each candidate problem several times with the
starting policy, measure its solve rate, and keep the problems inside a band. A problem the policy always
solves or never solves gives every completion the same reward, so its group-relative advantage is zero
and it only costs compute. INTELLECT-2 (arXiv 2505.07291) kept problems with a solve rate in 0.1-0.8
(measured with their base model); the band is configurable.

During the run the trainer drops groups whose rewards are all equal (``trainer/filtering.py``, the
online filter).

Shortcut: a task with a huge problem space (the embedded addition task has 10^6 problems) is filtered
over a sampled pool, not exhaustively; the result is a :class:`FilteredTask` over the kept problems.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from intellect_node.envs.tasks import Problem, Task
from intellect_node.errors import ConfigError
from intellect_node.fsutil import atomic_write_text

SOLVE_RATE_BAND = (0.1, 0.8)
"""INTELLECT-2's offline filter: keep problems the base model solves between 10% and 80% of the time."""


@dataclass(frozen=True)
class SolveRateBand:
    low: float = SOLVE_RATE_BAND[0]
    high: float = SOLVE_RATE_BAND[1]

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ConfigError(f"solve-rate band {self.low}..{self.high} must satisfy 0 <= low <= high <= 1",
                              field="solve_rate_band")

    def __contains__(self, rate: float) -> bool:
        return self.low <= rate <= self.high


RewardsFn = Callable[[Sequence[Problem], int], Sequence[Sequence[float]]]
"""``(problems, n) -> rewards[i][j]``: score n sampled completions of each problem with the policy."""


def measure_solve_rates(problems: Sequence[Problem], rewards_fn: RewardsFn, samples: int = 16,
                        *, batch: int = 32) -> dict[str, float]:
    """Mean reward (solve rate for 0/1 rewards) of each problem over ``samples`` completions."""
    if samples < 1:
        raise ConfigError("solve-rate samples must be at least 1", field="samples")
    rates: dict[str, float] = {}
    for start in range(0, len(problems), batch):
        chunk = problems[start:start + batch]
        scored = rewards_fn(chunk, samples)
        if len(scored) != len(chunk):
            raise ValueError(f"rewards_fn returned {len(scored)} rows for {len(chunk)} problems")
        for p, rs in zip(chunk, scored):
            rates[p.problem_id] = sum(rs) / max(len(rs), 1)
    return rates


class FilteredTask:
    """The problems of ``base`` that passed the offline filter (implements the ``Task`` protocol).

    Problem IDs are the base task's, so validators resolve and score them exactly as before.
    """

    def __init__(self, base: Task, kept: Sequence[Problem]) -> None:
        if not kept:
            raise ConfigError(f"the solve-rate filter kept no problem of task {base.task_id!r}; "
                              "widen the band or sample a larger pool", field="solve_rate_band")
        self.task_id = base.task_id
        self.base = base
        self._kept = list(kept)
        self._index = {p.problem_id: i for i, p in enumerate(self._kept)}

    def __len__(self) -> int:
        return len(self._kept)

    def problem(self, index: int) -> Problem:
        return self._kept[index]

    def get(self, problem_id: str) -> Problem:
        return self.base.get(problem_id)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self._kept[rng.randrange(len(self._kept))] for _ in range(n)]

    def index_of(self, problem_id: str) -> int:
        """The position of ``problem_id`` among the kept problems; ConfigError when it is not one."""
        try:
            return self._index[problem_id]
        except KeyError:
            raise ConfigError(f"{problem_id!r} is not among the offline-filtered problems of task "
                              f"{self.task_id!r}", field="problem_id") from None

    def __contains__(self, problem_id: object) -> bool:
        return problem_id in self._index


def offline_filter(task: Task, rates: dict[str, float], band: SolveRateBand = SolveRateBand(),
                   pool: Sequence[Problem] | None = None) -> FilteredTask:
    """Keep the problems of ``pool`` (default: every problem of ``task``) whose rate lies in ``band``."""
    candidates = list(pool) if pool is not None else [task.problem(i) for i in range(len(task))]
    kept = [p for p in candidates if p.problem_id in rates and rates[p.problem_id] in band]
    return FilteredTask(task, kept)


def save_solve_rates(path: str | Path, rates: dict[str, float]) -> None:
    atomic_write_text(path, json.dumps(rates, sort_keys=True))


def load_solve_rates(path: str | Path) -> dict[str, float]:
    try:
        raw = json.loads(Path(path).read_text())
        return {str(k): float(v) for k, v in raw.items()}
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{path}: not a solve-rate file ({exc}); re-run the offline filter",
                          field="solve_rates") from exc


def filter_by_rates_file(task: Task, path: str | Path, band: tuple[float, float]) -> FilteredTask:
    """The run's offline filter: ``task`` narrowed to the problems of a solve-rate file inside ``band``."""
    rates = load_solve_rates(path)
    pool = []
    for pid in sorted(rates):
        try:
            pool.append(task.get(pid))
        except ConfigError:
            raise ConfigError(f"rl.solve_rates_file {path}: {pid!r} is not a problem of task "
                              f"{task.task_id!r}; measure the rates for this run's task",
                              field="rl.solve_rates_file") from None
    return offline_filter(task, rates, SolveRateBand(*band), pool)
