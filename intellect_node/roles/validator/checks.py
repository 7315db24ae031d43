"""The validator's cheap checks of a decoded batch: what is decided before any reward is scored or any
tensor computed.

In order, the first that fails names the batch's refusal:

1. the batch matches its notice (run, version, rollout count): ``malformed``;
2. every record is the notice signer's: ``bad_signature``;
3. whole groups of ``rl.group_size`` records of one problem: ``groups``;
4. every record of the run's task and of its problems (``roles/common/tasks.wrong_task``): ``wrong_task``;
   of the offline filter's problems when the run has one: ``unknown_task``;
5. the sampling seeds and rollout IDs the run derives (``inference/verifier.seed_violation``): ``seed``;
6. exactly one of the worker's assignment windows at that version (``envs/assignment.py``): ``not_assigned``;
7. no rollout already counted at this version (``roles/common/seen.py``): ``duplicate``.

A pure function like ``intake.py``: it reads only its arguments (``seen`` is looked up, never changed) and
does no I/O, so tests call it directly; the validator decodes the bytes before and reserves the rollout
keys after.
"""

from __future__ import annotations

from dataclasses import dataclass

from intellect_node.envs.assignment import Assignments
from intellect_node.envs.filtering import FilteredTask
from intellect_node.envs.tasks import Task
from intellect_node.inference.verifier import seed_violation
from intellect_node.protocol.rl import RolloutNotice
from intellect_node.protocol.rollout import RolloutBatch
from intellect_node.roles.common.records import group_slices
from intellect_node.roles.common.seen import SeenRollouts, describe_key, rollout_keys
from intellect_node.roles.common.tasks import wrong_task


@dataclass(frozen=True)
class BatchRules:
    """What the run prescribes for every batch."""

    run_id: str
    group_size: int
    task: Task
    assignments: Assignments


@dataclass(frozen=True)
class Fault:
    """Why a batch is refused: a verdict reason and its detail."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Passed:
    """A batch that passed: its groups (slices of its records), the keys its rollouts count under, and the
    worker's assignment window it holds."""

    groups: list[slice]
    keys: list[str]
    window: int


def check_batch(batch: RolloutBatch, notice: RolloutNotice, worker: str, rules: BatchRules,
                seen: SeenRollouts) -> Fault | Passed:
    """The first cheap check ``batch`` fails (see the module doc), or its groups and rollout keys."""
    recs = batch.rollouts
    v = notice.policy_version
    if batch.run_id != rules.run_id or batch.policy_version != v or len(recs) != notice.n_rollouts:
        return Fault("malformed", "batch does not match its notice")
    if any(r.worker != worker for r in recs):
        return Fault("bad_signature", "records of another worker")
    groups = group_slices(recs, rules.group_size)
    if isinstance(groups, str):
        return Fault("groups", groups)
    wrong = wrong_task(rules.task, recs)
    if wrong:
        return Fault("wrong_task", wrong)
    if isinstance(rules.task, FilteredTask):
        outside = next((r.problem_id for r in recs if r.problem_id not in rules.task), None)
        if outside is not None:
            return Fault("unknown_task", f"{outside} is not among the run's offline-filtered problems")
    bad_seed = seed_violation(recs, rules.run_id, v, worker)
    if bad_seed:
        return Fault("seed", bad_seed)
    window = rules.assignments.check(worker, v, [r.problem_id for r in recs], rules.group_size)
    if isinstance(window, str):
        return Fault("not_assigned", window)
    keys = rollout_keys(recs)
    dup = seen.first_seen(v, keys)
    if dup is not None:
        return Fault("duplicate", f"{describe_key(dup)} at v{v} was already counted")
    return Passed(groups, keys, window)
