"""The scoring process's side of :mod:`intellect_node.envs.sandbox` (``python -m`` this module).

Reads length-prefixed pickles ``(module, function, args)`` from stdin and answers a length-prefixed
msgpack :class:`Reply` (data only: a number or an error message) on stdout. ``("", "import", (module,))``
imports a module ahead of the timed calls. The requests come from our own node, never from a peer, so
they may be pickles (a reasoning-gym entry holds tuples and sets); the replies come from a process that
has run a checker on hostile text, so the parent never unpickles them: a reply is decoded as a
:class:`Reply` and nothing else, under a size limit.

Kept free of heavy imports so a child starts fast; the checkers' modules are imported on request.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import pickle
import struct
import sys
import threading
import time
from typing import BinaryIO

import msgspec

MEMORY_ENV = "INTELLECT_NODE_SCORER_MEMORY"
"""Environment variable carrying the address-space limit in bytes (set by the parent)."""

_HEADER = struct.Struct(">I")
_MAX_REQUEST_BYTES = 64 << 20
MAX_REPLY_BYTES = 4096
"""Largest reply (a number and an error message of at most ``MAX_ERROR_CHARS``)."""
MAX_ERROR_CHARS = 300


class Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One answer: ``ok`` with the function's ``value`` (a float, or None for an import), or the error."""

    ok: bool
    value: float | None = None
    error: str = ""


def encode_reply(reply: Reply) -> bytes:
    return msgspec.msgpack.encode(reply)


def decode_reply(data: bytes) -> Reply:
    """The reply in ``data``; ValueError for anything else (too long, not a :class:`Reply`)."""
    if len(data) > MAX_REPLY_BYTES:
        raise ValueError(f"reply of {len(data)} bytes")
    try:
        reply = msgspec.msgpack.decode(data, type=Reply)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ValueError(f"not a reply: {exc}") from None
    if len(reply.error) > MAX_ERROR_CHARS:
        raise ValueError("reply error message too long")
    return reply


def _watch_parent(parent: int) -> None:
    """End this process once its parent is gone, even mid-checker (a hung sympy call would otherwise
    outlive a node that was killed). Polls: ``PR_SET_PDEATHSIG`` would need ``preexec_fn``, which is
    unsafe in a parent with threads."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def _die_with_parent(parent: int) -> None:
    """Ask Linux for SIGKILL when the parent goes: the watchdog thread cannot run while a checker holds
    the GIL in one long C call (a huge integer power). Set here, after exec, not in a ``preexec_fn``
    (unsafe in a threaded parent). The kernel signals when the *thread* that started this process ends;
    the parent then starts another child on its next call."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request: nobody would signal
        os._exit(0)


def _limit_memory() -> None:
    limit = int(os.environ.get(MEMORY_ENV, "0") or 0)
    if limit <= 0:
        return
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # not on this platform, or above a hard limit
        pass


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _run(module: str, function: str, args: tuple[object, ...]) -> float | None:
    if not module.startswith("intellect_node.envs.") and not (module == "" and function == "import"):
        raise ValueError(f"refused to run {module}.{function}")
    if module == "":
        importlib.import_module(str(args[0]))
        return None
    value = getattr(importlib.import_module(module), function)(*args)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{module}.{function} returned {type(value).__name__}, not a number")
    return float(value) if math.isfinite(value) else float("nan")


def main() -> None:
    parent = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    _die_with_parent(parent)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _limit_memory()
    # checkers' notices (math-verify warns that its own timeout is off: the parent is the timeout) would
    # land in the node's log once per child; errors still get through
    logging.disable(logging.WARNING)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a checker that prints must not corrupt the reply stream
    while True:
        head = _read_exact(stdin, _HEADER.size)
        if head is None:
            return  # the parent closed the pipe
        (size,) = _HEADER.unpack(head)
        if size > _MAX_REQUEST_BYTES:
            return
        body = _read_exact(stdin, size)
        if body is None:
            return
        try:
            module, function, args = pickle.loads(body)
            reply = Reply(ok=True, value=_run(module, function, args))
        except Exception as exc:  # noqa: BLE001 - this process's edge: any checker failure is an answer
            reply = Reply(ok=False, error=f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
        data = encode_reply(reply)
        stdout.write(_HEADER.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
