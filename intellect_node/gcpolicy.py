"""The cyclic garbage collector during a node's start-up: held off, then the start-up heap frozen.

A node imports torch, transformers, libp2p and aiohttp and builds its model before it does any work: the
heap grows from nothing to a few hundred thousand tracked objects. CPython (3.11) runs a full collection
whenever the long-lived generation has grown by a quarter, and each one walks the whole heap, so start-up
paid for five or six of them, the last ones 0.2-0.3 s each: about 1 CPU second per process, measured with
``gc.callbacks`` in ``bench/learning.py``'s three node processes (docs/architecture.md, node runtime).
Almost none of those objects is ever garbage.

:func:`defer` (the CLI's first step for the commands that run a node: ``join``, ``sweep``) turns the
collector off; :func:`settle` (the node runtime, once its services have started: the roles have imported
their stack and built their models) moves every object alive at that moment into the permanent generation
(``gc.freeze``), which later collections do not walk, and turns the collector back on. What start-up left
as cyclic garbage stays until exit: a bounded, one-time cost. A command that never settles (a ``sweep``
command that runs no node, a crash before ``running``) gets the collector back after :data:`DEFER_LIMIT_S`
anyway, so nothing runs unbounded without it.
"""

from __future__ import annotations

import gc
import threading

DEFER_LIMIT_S = 120.0
"""The latest the collector comes back on after :func:`defer`, settled or not."""

_lock = threading.Lock()
_timer: threading.Timer | None = None
_deferred = False


def defer(limit_s: float = DEFER_LIMIT_S) -> None:
    """Turn the cyclic collector off until :func:`settle`, or ``limit_s`` seconds at the latest."""
    global _timer, _deferred
    with _lock:
        if _deferred or not gc.isenabled():  # deferred already, or someone turned it off on purpose
            return
        gc.disable()
        _deferred = True
        _timer = threading.Timer(limit_s, settle)
        _timer.daemon = True
        _timer.name = "gc-defer-limit"
        _timer.start()


def settle() -> None:
    """Freeze what is alive now out of the collector's walks and turn the collector back on if
    :func:`defer` turned it off. Safe to call any number of times, from any thread."""
    global _timer, _deferred
    with _lock:
        gc.freeze()
        if _deferred:
            _deferred = False
            gc.enable()
        if _timer is not None:
            _timer.cancel()
            _timer = None


def deferred() -> bool:
    """Whether :func:`defer` holds the collector off now."""
    return _deferred
