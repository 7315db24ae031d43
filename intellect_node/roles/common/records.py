"""Verified rollout records as training samples: whole groups, rewards recomputed from the task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

from intellect_node.envs.tasks import Problem
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.trainer.step import Sample


def group_slices(records: Sequence[RolloutRecord], group_size: int) -> list[slice] | str:
    """Slices of consecutive ``group_size`` records of one problem; a reason string if the batch is not
    made of whole groups (the trainer's advantages need them)."""
    if len(records) % group_size:
        return f"{len(records)} rollouts are not whole groups of {group_size}"
    out = []
    for start in range(0, len(records), group_size):
        ids = {r.problem_id for r in records[start:start + group_size]}
        if len(ids) != 1:
            return f"rollouts {start}..{start + group_size - 1} mix problems"
        out.append(slice(start, start + group_size))
    return out


def record_to_sample(r: RolloutRecord, reward: float) -> Sample:
    return Sample(prompt_ids=tuple(r.prompt_tokens), completion_ids=tuple(r.completion_tokens),
                  old_logprobs=tuple(r.logprobs), reward=reward, policy_version=r.policy_version,
                  task_id=r.problem_id)


def rescored_group(recs: Sequence[RolloutRecord], problem: Problem,
                   decode: Callable[[list[int]], str]) -> list[Sample] | None:
    """One group's samples with each reward recomputed from the task (a worker's claimed reward is never
    used); None when this node's checker ran out of time on one of them (``timeout``): its reward is
    unknown here, and training on it as 0 would teach the policy that a right answer is wrong (a validator
    calls the same case ``reward_unjudged``). Other reasons for a 0 (no answer, too long, a checker
    error) are the completion's own and are trained on."""
    out = []
    for r in recs:
        judged = problem.judge(decode(list(r.completion_tokens)))
        if judged.reason == "timeout":
            return None
        out.append(record_to_sample(r, judged.reward))
    return out
