"""``validator/hops.jsonl``: when each verdict's batch came in, was fetched, and was judged.

One line per published verdict, in wall-clock seconds, for ``bench/learning.py`` (it joins them with the
trainer's and workers' lines): ``cid``, ``worker``, ``version``, ``accepted``, ``verdict`` (now),
``notice`` (when the notice was taken in; None for a verdict with no notice behind it) and ``fetched``
(None when the batch was never fetched here).

Shortcuts: diagnostics only, so the file is not fsynced (``fsutil.JsonlAppender`` with ``fsync=False``),
and past :data:`HOPS_MAX_BYTES` it is rotated to ``hops.jsonl.1`` (one old file kept). A fetch time is
remembered for the latest :data:`FETCHED_KEPT` batches only.
"""

from __future__ import annotations

import time
from pathlib import Path

from intellect_node.fsutil import JsonlAppender
from intellect_node.protocol.rl import BatchVerdict
from intellect_node.roles.common.seen import BoundedMap

HOPS_FILE = "hops.jsonl"
HOPS_MAX_BYTES = 16 << 20
"""``validator/hops.jsonl`` is rotated past this size."""
FETCHED_KEPT = 1024
"""Batches whose fetch time is remembered until their verdict (more are in flight only under a flood)."""


class HopsLog:
    """The hops of the verdicts of one validator, written to ``directory/hops.jsonl``."""

    def __init__(self, directory: Path) -> None:
        self._out = JsonlAppender(directory / HOPS_FILE, fsync=False, max_bytes=HOPS_MAX_BYTES)
        self._fetched: BoundedMap[tuple[str, str], float] = BoundedMap(FETCHED_KEPT)  # (worker, CID) -> time

    def fetched(self, worker: str, cid: str) -> None:
        """``worker``'s batch ``cid`` is here."""
        self._fetched.put((worker, cid), time.time())

    def verdict(self, verdict: BatchVerdict, arrived: float | None) -> None:
        """The line of a published verdict; ``arrived``: when its notice was taken in (monotonic)."""
        now, mono = time.time(), time.monotonic()
        self._out.append([{"cid": verdict.batch_cid, "worker": verdict.worker,
                           "version": verdict.policy_version, "accepted": verdict.accepted, "verdict": now,
                           "notice": None if arrived is None else now - (mono - arrived),
                           "fetched": self._fetched.get((verdict.worker, verdict.batch_cid))}])

    def close(self) -> None:
        self._out.close()
