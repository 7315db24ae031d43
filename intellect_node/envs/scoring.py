"""An environment's settings and the scorer they make, shared by every reward environment.

:class:`EnvSettings` holds what decides a reward and a prompt besides the problem itself (the answer
extraction, the system prompt, the scorer's time limit); :class:`Scorer` extracts the answer and runs the
check under the time limit, remembering judgements in a task's :class:`Memo`. ``environment.py`` builds
the run's task from them and ``reasoning_gym.py`` scores its datasets with them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from intellect_node.envs.extract import Extraction, extract
from intellect_node.envs.sandbox import DEFAULT_TIMEOUT_S, ScoringFailed
from intellect_node.envs.tasks import MAX_COMPLETION_CHARS, Judgement, bounded
from intellect_node.errors import ConfigError

DEFAULT_EXTRACTION = Extraction(mode="whole", think="keep", max_chars=MAX_COMPLETION_CHARS)
"""Task files and the embedded task: the whole completion, as before environments existed."""


@dataclass(frozen=True)
class EnvSettings:
    """The environment settings of a run (``[rl]``: answer_format, think, max_completion_chars,
    system_prompt, reward_timeout_s)."""

    extraction: Extraction = DEFAULT_EXTRACTION
    system: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 600:
            raise ConfigError(f"reward_timeout_s must be in (0, 600], got {self.timeout_s}",
                              field="rl.reward_timeout_s")

    def canonical(self) -> dict[str, object]:
        return {"extract": self.extraction.canonical(), "system": self.system}

    def digest(self, **more: object) -> str:
        """A short hash of these settings and ``more`` (a dataset's name and configuration)."""
        payload = json.dumps({**self.canonical(), **more}, sort_keys=True, separators=(",", ":"),
                             default=repr)
        return hashlib.sha256(payload.encode()).hexdigest()[:10]


MEMO_ENTRIES = 8192
"""Judgements remembered per task. A validator re-scores what the worker scored, and a hostile worker
can repeat one slow completion across a whole batch: each distinct (problem, answer) pays the checker's
time limit once per node, not once per rollout."""


class Memo:
    """A thread-safe LRU of judgements keyed by (problem ID, extracted answer's sha256)."""

    def __init__(self, size: int = MEMO_ENTRIES) -> None:
        self.size = size
        self._data: OrderedDict[tuple[str, bytes], Judgement] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, bytes]) -> Judgement | None:
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data.move_to_end(key)
            return hit

    def put(self, key: tuple[str, bytes], value: Judgement) -> None:
        with self._lock:
            self._data[key] = value
            while len(self._data) > self.size:
                self._data.popitem(last=False)


@dataclass(frozen=True)
class Scorer:
    """Extraction, then ``check(answer)`` under the settings' time limit; a :class:`Judgement` always.
    ``problem_id`` and ``memo`` (shared by a task's problems) remember answers already judged."""

    extraction: Extraction
    check: Callable[[str], float]
    problem_id: str = ""
    memo: Memo | None = field(default=None, compare=False, repr=False)

    def __call__(self, completion: str) -> Judgement:
        answer, why = extract(completion, self.extraction)
        if answer is None:
            return Judgement(0.0, why)
        key = (self.problem_id, hashlib.sha256(answer.encode("utf-8", "surrogatepass")).digest())
        if self.memo is not None and (hit := self.memo.get(key)) is not None:
            return hit
        try:
            judged = bounded(self.check(answer))
        except ScoringFailed as exc:
            judged = Judgement(0.0, exc.reason)
            if exc.reason == "budget":  # the sender's budget ran out, not a property of the answer
                return judged
        if self.memo is not None:
            self.memo.put(key, judged)
        return judged
