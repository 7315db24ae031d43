"""Stopping asyncio tasks: :func:`cancel_and_wait`, the one way every close path of the node ends its
tasks.

A single ``task.cancel()`` followed by ``gather`` waits for ever if the cancel is lost, and on Python 3.11
it can be: ``asyncio.wait_for`` returns its inner result when the cancel of the waiting task lands as that
result arrives, and a task that catches ``CancelledError`` to clean up may await something that absorbs a
second one. A node's stop hung this way once for 280 s (docs/architecture.md, "Stopping", under the node
runtime). So the cancel is sent again every ``resend_s`` until each task has ended, and a task still
running after ``warn_after_s`` is logged once with where it is stuck, so a stop that still hangs says why.
"""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any, Iterable

log = logging.getLogger(__name__)

RESEND_S = 1.0
WARN_AFTER_S = 10.0


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *, resend_s: float = RESEND_S,
                          warn_after_s: float = WARN_AFTER_S) -> None:
    """Cancel ``tasks`` and return once every one has ended (their results and exceptions are dropped:
    the caller is closing). Cancels lost on the way are sent again every ``resend_s`` seconds."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    started, warned = loop.time(), False
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=resend_s)
        if pending and not warned and loop.time() - started >= warn_after_s:
            warned = True
            for t in pending:
                where = io.StringIO()
                if isinstance(t, asyncio.Task):
                    t.print_stack(limit=8, file=where)
                log.warning("task %s still running %.0f s after its cancel (cancelled again every %.1f s):"
                            " %s",
                            t.get_name() if isinstance(t, asyncio.Task) else repr(t), loop.time() - started,
                            resend_s, where.getvalue() or "(no stack)")
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: a closing task's error is not reported as never retrieved
