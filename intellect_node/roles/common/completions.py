"""What the trainer and the workers show of the completions they score: a few recent ones per node, in
``snapshot.training.completions`` (``config/status.py``), so an operator whose run does not learn can see
what the model writes, what answer the run's extraction finds in it and what was expected.

One completion per group is shown (the group's first): consecutive groups are different problems, so a
handful of them spans several problems rather than one problem's samples.
"""

from __future__ import annotations

import time

from intellect_node.config.status import Completion
from intellect_node.envs.extract import Extraction, extract
from intellect_node.envs.tasks import MAX_COMPLETION_CHARS, Problem


def answer_of(problem: Problem, text: str) -> tuple[str | None, str]:
    """``(answer, "")`` as the run's checker sees it in ``text``, or ``(None, reason)``: the problem's
    extraction when its task has one (``envs/environment.py``), else the whole text (what a plain
    checker compares, ``envs/tasks.py``). Linear in the text: cheap beside the checker itself."""
    how = getattr(problem.scorer, "extraction", None)
    if not isinstance(how, Extraction):
        how = Extraction(mode="whole", think="keep", max_chars=MAX_COMPLETION_CHARS)
    return extract(text, how)


def completion(problem: Problem, text: str, reward: float, *, policy_version: int = -1,
               worker: str = "", ts: float | None = None) -> Completion:
    """One scored completion for the status board (which cuts and cleans its text)."""
    answer, reason = answer_of(problem, text)
    return Completion(ts=time.time() if ts is None else ts, problem_id=problem.problem_id,
                      prompt=problem.prompt, text=text, answer=answer, expected=problem.answer,
                      reward=float(reward), reason=reason, policy_version=policy_version, worker=worker)

