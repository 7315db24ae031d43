"""Progress of long CLI work: a rich bar on a terminal, periodic JSON lines on stderr otherwise.

Every command that can run for more than a few seconds (``blob put``/``get``, ``sweep polysemanticity``,
``tasks solve-rates``) reports through one :class:`Progress`, so an operator watching a terminal and a
supervisor reading a pipe see the same phases. The JSON form is one object per line on stderr::

    {"progress": "blob get", "phase": "fetching", "done": 1048576, "total": 4194304, "unit": "bytes",
     "elapsed_s": 1.2}

A line is written when a phase starts, at most every ``interval`` seconds while it advances, and once at
the end (``"phase": "done"`` or ``"failed"``); stdout keeps only the command's result, so
``cid=$(intellect-node blob put f)`` still works. ``INTELLECT_NODE_PROGRESS_INTERVAL`` changes the period
(seconds) of the JSON lines.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

ENV_INTERVAL = "INTELLECT_NODE_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 5.0
"""Often enough to tell a live job from a hung one in a log, rare enough not to flood it."""


class Progress:
    """One command's progress, through phases (``phase``) that each count toward a total (``update``)."""

    def __init__(self, what: str, *, quiet: bool = False, stream: TextIO | None = None,
                 interval: float | None = None, tty: bool | None = None) -> None:
        self.what = what
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        env = os.environ.get(ENV_INTERVAL)
        self.interval = interval if interval is not None else float(env) if env else DEFAULT_INTERVAL_S
        self.phase_name = ""
        self.done: float = 0
        self.total: float | None = None
        self.unit = ""
        self.fields: dict[str, object] = {}
        self._t0 = time.monotonic()
        self._last_line = 0.0
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._finished = False

    # -- context ----------------------------------------------------------------------------------

    def __enter__(self) -> Progress:
        if self.tty and not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                     TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                                     console=Console(file=self.stream), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finish("done" if exc_type is None else "failed")

    def finish(self, outcome: str = "done") -> None:
        """End the display with ``outcome`` as the last phase (only the first call counts); the JSON
        form writes its last line."""
        if self._finished:
            return
        self._finished = True
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None
        elif not self.quiet:
            self.phase_name = outcome
            self._line()

    # -- reporting --------------------------------------------------------------------------------

    def phase(self, name: str, /, *, total: float | None = None, done: float = 0, unit: str = "",
              **fields: object) -> None:
        """Start a phase (``fetching``, ``writing``, ``running jobs``): always shown at once."""
        self.phase_name, self.total, self.done, self.unit, self.fields = name, total, done, unit, fields
        if self.quiet:
            return
        if self._bar is not None:
            if self._task is not None:  # the phase before is over: a full, still bar
                old = self._bar.tasks[-1]
                self._bar.update(self._task, total=old.total or 1, completed=old.total or 1)
                self._bar.stop_task(self._task)
            self._task = self._bar.add_task(name, total=total, count=self._count())
            if done:  # rich counts a task's start in whole units; ours may be a fraction
                self._bar.update(self._task, completed=done)
        else:
            self._line()

    def update(self, done: float | None = None, /, *, total: float | None = None, **fields: object) -> None:
        """Move the current phase on; the JSON form writes a line when ``interval`` has passed."""
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        self.fields.update(fields)
        if self.quiet:
            return
        if self._bar is not None:
            if self._task is not None:
                self._bar.update(self._task, completed=self.done, total=self.total, count=self._count())
        elif time.monotonic() - self._last_line >= self.interval:
            self._line()

    def _count(self) -> str:
        if self.unit == "bytes":
            return f"{_human(self.done)}/{_human(self.total) if self.total is not None else '?'}"
        if self.total is not None:
            return f"{self.done:g}/{self.total:g} {self.unit}".rstrip()
        return f"{self.done:g} {self.unit}".rstrip() if self.done else ""

    def _line(self) -> None:
        self._last_line = time.monotonic()
        rec: dict[str, object] = {"progress": self.what, "phase": self.phase_name, "done": self.done,
                                  "total": self.total}
        if self.unit:
            rec["unit"] = self.unit
        rec.update(self.fields)
        rec["elapsed_s"] = round(self._last_line - self._t0, 1)
        self.stream.write(json.dumps(rec) + "\n")
        self.stream.flush()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
