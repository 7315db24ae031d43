"""``trainer/metrics.jsonl``: one fsynced line per step attempt (what the trainer's ``_record`` builds: the
step, version, rewards, filter counts, loss, staleness, each batch's hops), written before the checkpoint
that covers the step.

A replayed step (``roles/trainer/inbox.py``, ``StepJournal``) already has its line when the trainer died
after writing it: :attr:`MetricsFile.recorded_seq` is the journal entry of the last line, and only later
entries are recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import NotRequired, TypedDict

from intellect_node.fsutil import append_jsonl, read_jsonl

METRICS_FILE = "metrics.jsonl"


class StepTiming(TypedDict):
    """Where a trained step's time went, in seconds (``*_t``: wall-clock times)."""

    train_s: float
    publish_wait_s: float
    checkpoint_s: float
    publish_s: float
    taken_t: float
    trained_t: float


class StepLine(TypedDict):
    """One line of ``metrics.jsonl``, in the order its keys are written; :class:`StepTiming`'s keys end the
    line of a step that trained and are absent from one that did not."""

    step: int
    version: int
    trained: bool
    time: float
    seq: int
    pass_rate: float
    reward_mean: float
    samples: int
    groups: int
    groups_used: int
    filtered_fraction: float
    no_signal: str
    """Why no group was learnable (``trainer/filtering.py``); "" when one was."""
    loss: float
    grad_norm: float
    clipped_frac: float
    kl_sampler: float
    ratio_mean: float
    ratio_max: float
    lr: float
    entropy: float
    loss_kind: str
    staleness_mean: float
    staleness_max: int
    batch_ages: list[int]
    accepted: int
    rejected: int
    stale: int
    idle_fraction: float
    batches: list[str]
    hops: dict[str, dict[str, str | float]]
    """Each taken batch's worker and hops (notice heard, prefetched, verdict heard, admitted: wall-clock
    seconds), by batch CID."""
    published: dict[str, float]
    train_s: NotRequired[float]
    publish_wait_s: NotRequired[float]
    checkpoint_s: NotRequired[float]
    publish_s: NotRequired[float]
    taken_t: NotRequired[float]
    trained_t: NotRequired[float]


class MetricsFile:
    """The trainer's metrics file in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / METRICS_FILE
        self.recorded_seq = self._last_recorded_seq()
        """The newest journal entry with a line in the file."""

    def _last_recorded_seq(self) -> int:
        for record in reversed(read_jsonl(self.path)):  # a line torn by a crash is skipped
            seq = record.get("seq", 0)
            if not isinstance(seq, (int, float, str)):
                continue
            try:
                return int(seq)
            except ValueError:
                continue
        return 0

    def records(self, seq: int) -> bool:
        """Whether the step of journal entry ``seq`` still needs its line."""
        return seq > self.recorded_seq

    def write(self, line: StepLine, seq: int) -> None:
        """Append the line of journal entry ``seq`` (blocking: one fsynced append)."""
        append_jsonl(self.path, line)
        self.recorded_seq = seq
