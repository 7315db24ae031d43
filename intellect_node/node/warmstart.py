"""Children started warm: forked from a server that imported torch, libp2p and the node once.

A cold ``intellect-node join`` spends seconds of CPU importing (torch alone is most of it) before it
reads its config. A swarm started on one machine (the tests, the demo) pays that once per node, and on
two cores the imports of a few nodes starting together are most of their start. :class:`WarmStarter`
keeps one server process, multiprocessing's ``forkserver`` with the heavy modules imported and no thread
started, and forks each child from it. The child then does what an exec would have set up: the
environment, the working directory, a session of its own if asked, stdin from ``/dev/null``, stdout and
stderr to the output file, SIGTERM when its parent goes; and runs the command as its interpreter would
(the console script, or ``-m module``), its atexit handlers at the end. ``ps`` shows the command's name;
its command line stays the server's.

:class:`WarmChild` answers what :class:`intellect_node.node.processes.NodeProcess` asks of a ``Popen``
(``pid``, ``poll``, ``wait``): the exit status comes back through the server, which is the child's
parent (a signal's death reads as ``-signum``, as with ``Popen``). The PID is the node's own, so a
supervisor still ends its children by the PID it holds.

What a warm child does not share with a cold one: a module imported by the server read its environment
variables then, not the child's (``torch`` reads ``OMP_NUM_THREADS`` at import: the server is started with
1, what every child here gets). Modules that read the environment at import and that a child may be
given otherwise (``huggingface_hub``, ``transformers``) are not preloaded. Commands the server cannot run
this way (a wrapper such as ``ip netns exec`` or ``prlimit``, another interpreter) are started cold.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOAD = (
    "torch",
    "aiohttp",
    "libp2p",
    "intellect_node.cli",
    "intellect_node.node.assembly",
    "intellect_node.node.runtime",
    "intellect_node.roles.trainer.role",
    "intellect_node.roles.validator.role",
    "intellect_node.roles.worker.role",
    "intellect_node.p2p.host",
    "intellect_node.p2p.nat.service",
    "intellect_node.node.metrics",
    "intellect_node.envs.reasoning_gym",
    "tokenizers",
    "jinja2",
    "safetensors",
)
"""What the server imports before it forks anyone: what every node imports and that takes longest."""

SERVER_ENV = {"OMP_NUM_THREADS": "1"}
"""The server's environment on top of this process's: read by modules at import (see the docstring)."""

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
"""From <linux/prctl.h>."""


class WarmChild:
    """A child forked by the server, with ``Popen``'s ``pid``, ``poll``, ``wait`` and ``returncode``."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        pid = process.pid
        assert pid is not None  # started
        self.pid: int = pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
        return code


class WarmStarter:
    """Forks children from one preloaded server (started on first use, ended with this process)."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.preload = list(preload)
        self._lock = threading.Lock()
        self._ctx: multiprocessing.context.ForkServerContext | None = None

    @staticmethod
    def runs(argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a command a warm child can run: this interpreter's console script, or
        ``<this interpreter> -m module``."""
        if not argv:
            return False
        here = Path(sys.executable)
        if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
            return True
        return Path(argv[0]) == here.with_name("intellect-node")

    def _context(self) -> multiprocessing.context.ForkServerContext:
        with self._lock:
            if self._ctx is None:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(self.preload)
                saved = {k: os.environ.get(k) for k in SERVER_ENV}
                os.environ.update(SERVER_ENV)
                try:
                    multiprocessing.forkserver.ensure_running()
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                self._ctx = ctx
            return self._ctx

    def start(self, argv: Sequence[str], *, output: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, new_session: bool = False, die_with_parent: bool = True) -> WarmChild:
        """Fork a child running ``argv`` (see :meth:`runs`), its stdout and stderr appended to ``output``."""
        if not self.runs(argv):
            raise ValueError(f"a warm child cannot run {list(argv)[:3]!r}: start it with Popen")
        ctx = self._context()
        process = ctx.Process(target=_child_main, name=f"warm:{Path(argv[0]).name}", args=(
            list(argv), dict(env if env is not None else os.environ), str(cwd) if cwd else None, str(output),
            new_session, die_with_parent))
        process.start()
        # Not one of multiprocessing's children to join at this process's exit (a node never ends on its
        # own): as with an exec'd child, this process exits when it will, and the child gets SIGTERM
        # when the server, whose child it is, goes with it (PR_SET_PDEATHSIG, set in the child).
        children = getattr(multiprocessing.process, "_children", None)
        if isinstance(children, set):
            children.discard(process)
        return WarmChild(process)


def _child_main(argv: list[str], env: dict[str, str], cwd: str | None, output: str, new_session: bool,
                die_with_parent: bool) -> None:
    """In the child: what exec and the interpreter's start would have set up, then the command."""
    server = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        if die_with_parent:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
            if os.getppid() != server:  # the server went before the request was made: no signal comes
                os._exit(1)
        # What ps and top show as its name (the command line stays the server's).
        name = argv[2].rsplit(".", 1)[-1] if argv[1:2] == ["-m"] else Path(argv[0]).name
        prctl(PR_SET_NAME, name.encode()[:15])
    # multiprocessing gives every child the write end of the server's "parent alive" pipe, so the server
    # lives while any child does; closed here, the server ends with this child's parent, and the
    # PR_SET_PDEATHSIG above then ends the child, as an exec'd child's would.
    client = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive = getattr(client, "_forkserver_alive_fd", None)
    if client is not None and isinstance(alive, int):
        os.close(alive)
        client._forkserver_alive_fd = None
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import runpy

    try:
        if argv[1:2] == ["-m"]:
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:  # the console script itself, as its interpreter runs it
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()
