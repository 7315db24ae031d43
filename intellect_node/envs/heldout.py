"""The run's held-out problems: a part of its task no worker is ever assigned, evaluated instead.

With ``run.eval_every`` on, the run's task (after the offline filter, when one is set) is split in two by
one rule every node computes the same way:

1. A keyed pseudo-random permutation of the task's indexes (``envs.assignment.Permutation``, keyed by the
   run ID and the task ID) orders the task.
2. The first ``run.eval_problems`` positions of that order are the *held-out* problems, in that order:
   held-out problem ``j`` is task index ``order(j)``.
3. The remaining positions are the *training* task: its index ``k`` is task index ``order(n + k)``.

Both parts keep the task's problem IDs, so a held-out problem is scored exactly as it would be in
training. Since the permutation is a bijection, the parts are disjoint by construction: the training
part's :meth:`TrainingPart.get` refuses a held-out ID, so the assignment (``envs/assignment.py``)
never hands one out and the validators' and trainer's task check refuses a rollout of one as work on
another task. The rule works the same for every task kind: for the embedded task and task files an
index is a line or an addition, for reasoning-gym an index ``i`` is the item generated from
``Random(seed + i)``, so the two parts draw from disjoint generator states.

Shortcut: the parts are disjoint by problem, not by content. A task whose problem space is small
(reasoning-gym's sums of two digits, a task file with repeated lines) can hold the same question under
two indexes, one in each part.
"""

from __future__ import annotations

import random

from intellect_node.envs.assignment import Permutation, task_index
from intellect_node.envs.tasks import Problem, Task
from intellect_node.errors import ConfigError

DOMAIN = b"intellect/held-out/1\0"


class Split:
    """The run's task cut into its held-out and training parts (the module docstring's rule)."""

    def __init__(self, task: Task, run_id: str, n: int) -> None:
        size = len(task)
        if not 1 <= n <= size // 2:
            raise ConfigError(f"run.eval_problems {n}: the run's task {task.task_id!r} has {size} problems "
                              f"and at most half of them ({size // 2}) may be held out of training; lower "
                              "run.eval_problems", field="run.eval_problems")
        self.task = task
        self.n = n
        self.order = Permutation(DOMAIN + f"{run_id}\0{task.task_id}".encode("utf-8"), size)
        self.held_out = HeldOutPart(self)
        self.training = TrainingPart(self)

    def position(self, problem_id: str) -> int:
        """Where ``problem_id`` sits in the split's order (below ``n``: held out); ConfigError when it
        is not a problem of the task."""
        return self.order.inverse(task_index(self.task, problem_id))


class HeldOutPart:
    """The held-out problems, ``n`` of them in the split's order (implements the ``Task`` protocol)."""

    def __init__(self, split: Split) -> None:
        self._split = split
        self.task_id = split.task.task_id

    def __len__(self) -> int:
        return self._split.n

    def problem(self, index: int) -> Problem:
        if not 0 <= index < self._split.n:
            raise ConfigError(f"held-out problem {index} out of range 0..{self._split.n - 1}", field="index")
        return self._split.task.problem(self._split.order(index))

    def index_of(self, problem_id: str) -> int:
        j = self._split.position(problem_id)
        if j >= self._split.n:
            raise ConfigError(f"{problem_id!r} is a training problem, not a held-out one", field="problem_id")
        return j

    def get(self, problem_id: str) -> Problem:
        return self.problem(self.index_of(problem_id))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problem(rng.randrange(self._split.n)) for _ in range(n)]


class TrainingPart:
    """The task without its held-out problems (implements the ``Task`` protocol): what the run's
    assignment, workers, validators and trainer use."""

    def __init__(self, split: Split) -> None:
        self._split = split
        self.task_id = split.task.task_id
        self.base = split.task

    @property
    def held_out(self) -> HeldOutPart:
        """The other part: the problems this one leaves out."""
        return self._split.held_out

    def __len__(self) -> int:
        return len(self._split.task) - self._split.n

    def problem(self, index: int) -> Problem:
        if not 0 <= index < len(self):
            raise ConfigError(f"problem index {index} out of range 0..{len(self) - 1}", field="index")
        return self._split.task.problem(self._split.order(self._split.n + index))

    def index_of(self, problem_id: str) -> int:
        """The problem's index in the training part; ConfigError for a held-out one (or none of the
        task's)."""
        k = self._split.position(problem_id) - self._split.n
        if k < 0:
            raise ConfigError(f"{problem_id!r} is held out of training for evaluation (run.eval_every)",
                              field="problem_id")
        return k

    def get(self, problem_id: str) -> Problem:
        self.index_of(problem_id)
        return self._split.task.get(problem_id)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problem(rng.randrange(len(self))) for _ in range(n)]
