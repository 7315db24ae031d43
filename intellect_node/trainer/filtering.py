"""The online filter (INTELLECT-2, arXiv 2505.07291): drop any group whose rewards are all equal. Its
group-relative advantage is zero, so it only costs compute. :func:`filter_groups` also says why, when it
drops every group of a step (:func:`no_signal_cause`): a run where that keeps happening cannot learn, and
the trainer says so (``config/status.py``). The offline filter, which chooses the problems before a run, is
``envs/filtering.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")

MAX_REWARD = 1.0
"""Rewards lie in [0, 1] (``envs/tasks.py``): a group all at 1 was solved by every sample."""


@dataclass(frozen=True)
class FilteredGroups(Generic[T]):
    """What the online filter made of one step's groups."""

    useful: list[Sequence[T]]
    """The groups whose rewards are not all equal, in their order."""
    total: int
    cause: str
    """Why no group is useful (:func:`no_signal_cause`); "" when one is."""

    @property
    def dropped(self) -> int:
        return self.total - len(self.useful)


def filter_groups(groups: Sequence[Sequence[T]], reward: Callable[[T], float]) -> FilteredGroups[T]:
    """The online filter: the groups whose rewards are not all equal (zero-advantage groups dropped),
    with the cause when it drops them all."""
    useful: list[Sequence[T]] = []
    levels: set[float] = set()  # the reward of each dropped group
    for g in groups:
        rs = [reward(x) for x in g]
        if rs and max(rs) != min(rs):
            useful.append(g)
        elif rs:
            levels.add(rs[0])
    return FilteredGroups(useful, len(groups), "" if useful else no_signal_cause(levels))


def no_signal_cause(levels: set[float]) -> str:
    """Why groups whose rewards are each equal, at the rewards ``levels``, give nothing to learn from:
    ``all_zero`` (no sample solved anything), ``all_one`` (every sample solved its problem),
    ``all_equal`` (any other mix: partial credit, or groups at 0 beside groups at 1) or ``no_groups``."""
    if not levels:
        return "no_groups"
    if levels == {0.0}:
        return "all_zero"
    if levels == {MAX_REWARD}:
        return "all_one"
    return "all_equal"
