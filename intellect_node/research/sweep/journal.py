"""The sweep's journal: the coordinator's header and every event it emitted, one JSON line each.

Events are appended (flushed and fsynced) before the node sends the grants or acknowledges the results
they record, so a crash loses nothing that was acted on; ``Coordinator.restore`` replays them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.fsutil import JsonlAppender, atomic_write_text

if TYPE_CHECKING:
    from intellect_node.research.sweep.coordinator import SweepEvent

log = logging.getLogger(__name__)


class Journal:
    """Append-only JSON lines: a header, then events. Each append is flushed and fsynced before return."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._out = JsonlAppender(self.path, sort_keys=True)

    def create(self, header: dict[str, Any]) -> None:
        if self.path.exists():
            raise ConfigError(f"{self.path} exists: pass --resume to continue that sweep, or another --out",
                              field="out")
        atomic_write_text(self.path, json.dumps(header, sort_keys=True) + "\n")

    def load(self) -> tuple[dict[str, Any], list[SweepEvent]]:
        """The header and events; a torn last line (a crash mid-append) is dropped, anything else fails."""
        if not self.path.exists():
            raise ConfigError(f"--resume: no journal at {self.path}; start the sweep without --resume",
                              field="resume")
        lines = self.path.read_text().splitlines()
        events = []
        for i, line in enumerate(lines):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(lines) - 1 and i > 0:
                    log.warning("dropping a torn last line of %s", self.path)
                    break
                raise ProtocolError(f"{self.path}:{i + 1} is not JSON: {exc}") from exc
        if not events or events[0].get("e") != "header":
            raise ProtocolError(f"{self.path} does not start with a sweep header")
        return events[0], events[1:]

    def append(self, events: Sequence[SweepEvent]) -> None:
        self._out.append(events)

    def close(self) -> None:
        self._out.close()
