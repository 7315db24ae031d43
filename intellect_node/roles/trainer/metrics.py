"""``trainer/metrics.jsonl``: one fsynced line per step attempt (what the trainer's ``_record`` builds: the
step, version, rewards, filter counts, loss, staleness, each batch's hops), written before the checkpoint
that covers the step.

A replayed step (``roles/trainer/inbox.py``, ``StepJournal``) already has its line when the trainer died
after writing it: :attr:`MetricsFile.recorded_seq` is the journal entry of the last line, and only later
entries are recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from intellect_node.fsutil import append_jsonl, read_jsonl

METRICS_FILE = "metrics.jsonl"


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

    def write(self, line: dict[str, Any], seq: int) -> None:
        """Append the line of journal entry ``seq`` (blocking: one fsynced append)."""
        append_jsonl(self.path, line)
        self.recorded_seq = seq
