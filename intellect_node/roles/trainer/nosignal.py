"""A step attempt with no learnable group, said so: the status board's count, the hint, one warning a streak.

A step attempt whose groups all have equal rewards trains nothing: its batches are consumed (journaled,
recorded in ``metrics.jsonl`` with ``trained`` false and the cause), no version is made, and the step
record naming the batches gives each worker its batches back (``roles/worker/pacing.py``).
:meth:`NoSignal.attempted` reports every attempt to the status board (``board.train_attempt``: groups
dropped, the cause when all were, a hint naming the settings to check); a streak of them raises
``training.no_signal_warning``, logged once per streak as a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from intellect_node.config import RLConfig
from intellect_node.config.status import Completion, StatusBoard
from intellect_node.trainer.filtering import FilteredGroups
from intellect_node.trainer.step import Sample

log = logging.getLogger(__name__)


class NoSignal:
    """Reports step attempts to ``board``; ``rl``: the run's settings the hints name."""

    def __init__(self, board: StatusBoard, rl: RLConfig) -> None:
        self._board = board
        self._rl = rl
        self._logged = False  # the current streak's warning went to the log

    def attempted(self, filtered: FilteredGroups[Sample], samples: list[Sample], shown: Sequence[Completion],
                  answer_mode: str) -> None:
        """Report an attempt; ``shown``: recent completions, ``answer_mode``: the answer format as the task
        resolved it ("" when no group was scored yet)."""
        cause = filtered.cause
        hint_text = hint(cause, samples, shown, answer_mode, self._rl) if cause else ""
        self._board.train_attempt(groups=filtered.total, filtered=filtered.dropped, cause=cause,
                                  hint=hint_text)
        if not cause:
            self._logged = False
            return
        warning = self._board.snapshot().training.no_signal_warning
        if warning and not self._logged:
            log.warning("%s", warning)
            self._logged = True


def hint(cause: str, samples: list[Sample], shown: Sequence[Completion], answer_mode: str,
         rl: RLConfig) -> str:
    """The likely causes of an attempt with no learnable group, naming the settings to check."""
    if cause == "all_zero":
        cut = sum(1 for s in samples if len(s.completion_ids) >= rl.max_new_tokens) / max(len(samples), 1)
        missing = sum(1 for c in shown if c.answer is None)
        mode = answer_mode or "whole"
        fmt = f"auto: {mode}" if rl.answer_format == "auto" else rl.answer_format
        return (f"every reward 0: completions too short (rl.max_new_tokens {rl.max_new_tokens}, "
                f"{cut:.0%} reach it), an answer format the model does not write (rl.answer_format "
                f"{fmt}, no answer in {missing}/{len(shown)}), or a task too hard for the model; "
                "see the recent completions")
    if cause == "all_one":
        return ("every reward 1: the task is too easy for the model; raise its difficulty (rl.env_args) "
                "or pick a harder task (rl.task, rl.tasks_file)")
    if cause == "all_equal":
        return ("each group's rewards are equal (problems always or never solved, or partial credit "
                "alike): spread the difficulty (rl.env_args), or vary the samples more (rl.temperature "
                f"{rl.temperature}, rl.group_size {rl.group_size})")
    return (f"no group could be judged: the reward checker ran out of time on each "
            f"(rl.reward_timeout_s {rl.reward_timeout_s})")
