"""The scoring process's side of :mod:`intellect_node.envs.sandbox` (``python -m`` this module).

Reads length-prefixed pickles ``(module, function, args)`` from stdin, answers ``("ok", value)`` or
``("err", "Type: message")`` on stdout. ``("", "import", (module,))`` imports a module ahead of the timed
calls. The parent is our own node (the pickles come from it, never from a peer); the *arguments* are
hostile text, which is why this process exists: whatever a checker does with them stays here.

Kept free of heavy imports so a child starts fast; the checkers' modules are imported on request.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import struct
import sys
import threading
import time

MEMORY_ENV = "INTELLECT_NODE_SCORER_MEMORY"
"""Environment variable carrying the address-space limit in bytes (set by the parent)."""

_HEADER = struct.Struct(">I")
_MAX_REQUEST_BYTES = 64 << 20


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


def _read_exact(stream, n: int) -> bytes | None:  # type: ignore[no-untyped-def]
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _run(module: str, function: str, args: tuple[object, ...]) -> object:
    if not module.startswith("intellect_node.envs.") and not (module == "" and function == "import"):
        raise ValueError(f"refused to run {module}.{function}")
    if module == "":
        importlib.import_module(str(args[0]))
        return None
    return getattr(importlib.import_module(module), function)(*args)


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
            reply: tuple[str, object] = ("ok", _run(module, function, args))
        except Exception as exc:  # noqa: BLE001 - this process's edge: any checker failure is an answer
            reply = ("err", f"{type(exc).__name__}: {str(exc)[:300]}")
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result is the checker's fault
            data = pickle.dumps(("err", f"unpicklable result: {type(exc).__name__}"))
        stdout.write(_HEADER.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
