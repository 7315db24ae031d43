"""Operator-supplied tasks from a JSONL file: one problem per line, ``{"prompt", "answer", "checker"}``.

    {"prompt": "2+2=", "answer": "4", "checker": "integer"}
    {"prompt": "Capital of France?", "answer": "Paris"}            # checker defaults to "exact"
    {"id": "q17", "prompt": "...", "answer": "..."}                  # optional stable id
    {"prompt": "Half of 1?", "answer": "\\frac{1}{2}", "checker": "math"}   # math-verify: 0.5 matches

Checkers are those of :data:`~intellect_node.envs.tasks.CHECKERS`: ``exact``, ``integer`` and ``math``
(math-verify, run in a scoring process under a time limit; docs/environments.md). The run's extraction
settings (``rl.answer_format``, ``rl.think``) and system prompt apply on top, through
``intellect_node.envs.environment.build_task``.

The file becomes a :class:`~intellect_node.envs.tasks.Task` named by ``task_id`` (default: the file's
stem); problem IDs are ``<task_id>/<line index>`` like the embedded task's, so workers, validators and the
trainer resolve the same problem from a rollout. Every node of a run loads the same file (its hash goes in
the run config), so the reward a validator recomputes is the one the operator meant.

Loading is strict: a malformed line is a ConfigError naming the file and line, with a size cap per line
and per file, because a task file is operator input and mistakes should stop the node at start.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from intellect_node.envs.tasks import CHECKERS, Problem, register_task
from intellect_node.errors import ConfigError

MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_LINE_BYTES = 64 * 1024
_FIELDS = {"id", "prompt", "answer", "checker"}


class JsonlTask:
    """A fixed list of problems read from a JSONL file (implements the ``Task`` protocol)."""

    def __init__(self, task_id: str, problems: list[Problem], sha256: str = "") -> None:
        if not problems:
            raise ConfigError(f"task {task_id!r} has no problems", field="tasks_file")
        self.task_id = task_id
        self._problems = problems
        self._by_id = {p.problem_id: p for p in problems}
        self.checkers = frozenset(p.checker for p in problems)
        """The checker kinds its problems name (``envs.environment.settle`` gives ``math`` a memo)."""
        self.sha256 = sha256
        """Hash of the file's bytes: what a run config pins so every node scores the same problems."""

    def __len__(self) -> int:
        return len(self._problems)

    def problem(self, index: int) -> Problem:
        if not 0 <= index < len(self._problems):
            raise ConfigError(f"problem index {index} out of range 0..{len(self._problems) - 1}",
                              field="index")
        return self._problems[index]

    def get(self, problem_id: str) -> Problem:
        try:
            return self._by_id[problem_id]
        except KeyError:
            raise ConfigError(f"{problem_id!r} is not a problem of task {self.task_id!r}",
                              field="problem_id") from None

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self._problems[rng.randrange(len(self._problems))] for _ in range(n)]


def _problem(task_id: str, index: int, raw: bytes, where: str) -> Problem:
    if len(raw) > MAX_LINE_BYTES:
        raise ConfigError(f"{where}: line longer than {MAX_LINE_BYTES} bytes", field="tasks_file")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not JSON ({exc})", field="tasks_file") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected an object with prompt/answer", field="tasks_file")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}",
                          field="tasks_file")
    prompt, answer = obj.get("prompt"), obj.get("answer")
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string", field="tasks_file")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise ConfigError(f"{where}: 'answer' must be a string or a number", field="tasks_file")
    checker = obj.get("checker", "exact")
    if checker not in CHECKERS:
        raise ConfigError(f"{where}: checker {checker!r} is not one of {sorted(CHECKERS)}",
                          field="tasks_file")
    return Problem(task_id=task_id, problem_id=f"{task_id}/{index}", prompt=prompt, answer=answer,
                   checker=checker)


def load_jsonl_tasks(path: str | Path, task_id: str | None = None, *, register: bool = True) -> JsonlTask:
    """Read ``path`` into a task; with ``register`` it becomes resolvable by ``get_task(task_id)``."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"--tasks {path}: cannot read ({exc.strerror}); pass a JSONL file",
                          field="tasks_file") from exc
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"--tasks {path}: {size} bytes exceeds {MAX_FILE_BYTES}", field="tasks_file")
    data = path.read_bytes()
    tid = task_id or path.stem
    if not tid or "/" in tid:
        raise ConfigError(f"task id {tid!r} must be non-empty and contain no '/'", field="task_id")
    problems: list[Problem] = []
    seen_ids: set[str] = set()
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        p = _problem(tid, len(problems), raw, f"{path}:{lineno}")
        ext = json.loads(raw).get("id")
        if ext is not None:
            if not isinstance(ext, str) or ext in seen_ids:
                raise ConfigError(f"{path}:{lineno}: 'id' must be a unique string", field="tasks_file")
            seen_ids.add(ext)
        problems.append(p)
    task = JsonlTask(tid, problems, sha256=hashlib.sha256(data).hexdigest())
    if register:
        register_task(tid, lambda: task)
    return task
