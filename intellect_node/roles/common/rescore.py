"""A batch its validators accepted, checked once more and turned into groups of samples with rewards the
trainer computed itself (claimed rewards are never used).

:meth:`Rescorer.groups` runs in a worker thread (a reward checker may run up to ``rl.reward_timeout_s``
on hostile text) and, in order:

1. checks that the batch is the run's, of the verdict's version, and every record names the worker;
2. checks every record's signature: a validator cannot plant records under an honest worker's name
   (``bad_signature``, not held against the worker);
3. checks every problem is of the run's task (``wrong_task``);
4. cuts the records into whole groups, checks they fill one of the worker's assignment windows at that
   version (``not_assigned``: ``envs/assignment.py``), and re-scores each group from the task; a group
   whose reward this node could not judge in time is left out (counted in :attr:`Rescorer.unjudged`).

The first completion of each group goes to the status board (``training.completions``) and to
:attr:`Rescorer.shown`, which the no-signal hint (``nosignal.py``) counts missing answers over.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from intellect_node.config.status import Completion, StatusBoard
from intellect_node.envs.assignment import Assignments
from intellect_node.envs.extract import Extraction
from intellect_node.envs.tasks import Task
from intellect_node.errors import ProtocolError
from intellect_node.protocol.rollout import RolloutBatch, verify_rollout_signature
from intellect_node.roles.common.completions import completion
from intellect_node.roles.common.records import group_slices, rescored_group
from intellect_node.roles.common.tasks import wrong_task
from intellect_node.trainer.step import Sample

log = logging.getLogger(__name__)

SHOWN_LEN = 32
"""Recent completions (one per admitted group) the no-signal hint counts missing answers over."""


class RefusedBatch(ProtocolError):
    """A batch its validators accepted that the trainer refuses itself: ``reason`` (a verdict reason) and
    ``workers_fault`` (held against the worker: only it could have signed what is wrong)."""

    reason = "refused"
    workers_fault = True

    def __init__(self, message: str, *, reason: str | None = None, workers_fault: bool | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        if workers_fault is not None:
            self.workers_fault = workers_fault


class Rescorer:
    """Checks and re-scores the batches of ``run_id`` on ``task`` (see the module docstring)."""

    def __init__(self, task: Task, decode: Callable[[list[int]], str], *, run_id: str, group_size: int,
                 board: StatusBoard, assignments: Assignments) -> None:
        self._task = task
        self._assignments = assignments
        self._decode = decode
        self._run_id = run_id
        self._group_size = group_size
        self._board = board
        self.unjudged = 0
        """Groups left out because their reward could not be judged in time."""
        # Newest last (appended from the admission thread).
        self.shown: collections.deque[Completion] = collections.deque(maxlen=SHOWN_LEN)
        self.answer_mode = ""
        """The answer format as the task resolves it (for ``rl.answer_format`` "auto"), once a group was
        scored."""

    def window_of(self, worker: str, version: int, problem_id: str) -> int | None:
        """The assignment window of ``worker`` at ``version`` holding ``problem_id`` (None: none does)."""
        return self._assignments.window_of(worker, version, problem_id)

    def groups(self, batch: RolloutBatch, worker: str, version: int) -> list[list[Sample]]:
        """``batch``'s groups; raises ProtocolError (or :class:`RefusedBatch`) for a batch to refuse."""
        recs = batch.rollouts
        if batch.run_id != self._run_id or batch.policy_version != version \
                or any(r.worker != worker for r in recs):
            raise ProtocolError("batch does not match its verdict")
        for i, r in enumerate(recs):  # the worker's own records, not ones planted under its name
            try:
                verify_rollout_signature(r)
            except ProtocolError as exc:
                raise RefusedBatch(f"record {i}: {exc}", reason="bad_signature",
                                   workers_fault=False) from None
        wrong = wrong_task(self._task, recs)
        if wrong:
            raise RefusedBatch(wrong, reason="wrong_task")
        slices = group_slices(recs, self._group_size)
        if isinstance(slices, str):
            raise ProtocolError(slices)
        window = self._assignments.check(worker, version, [r.problem_id for r in recs], self._group_size)
        if isinstance(window, str):
            raise RefusedBatch(window, reason="not_assigned")
        out = []
        shown: list[Completion] = []
        texts: list[str] = []

        def decode(ids: list[int]) -> str:  # the re-scoring's own decode, its texts kept for the status
            text = self._decode(ids)
            texts.append(text)
            return text

        for sl in slices:
            problem = self._task.get(recs[sl.start].problem_id)
            texts.clear()
            group = rescored_group(recs[sl], problem, decode)
            if group is None:  # a reward this node could not judge in time: the group is left out
                self.unjudged += 1
                log.warning("batch of %s at v%d: a group of %s left out (the reward checker timed out here)",
                            worker, version, recs[sl.start].problem_id)
                continue
            out.append(group)
            shown.append(completion(problem, texts[0], group[0].reward, policy_version=version,
                                    worker=worker))
            if not self.answer_mode:
                how = getattr(problem.scorer, "extraction", None)
                self.answer_mode = how.mode if isinstance(how, Extraction) else "whole"
        self.shown.extend(shown)
        self._board.completions(shown)
        return out
