"""Nodes as child processes: start one, wait until it answers, read its status, signal it, stop it.

The one supervisor of child nodes: ``intellect-node demo`` (a swarm of ``join`` processes),
``intellect-node sweep`` (its local sweep workers), the tests and ``bench/`` all start their children
here, so they agree on how a child is started, when it counts as ready and how it is ended::

    node = NodeProcess.join(data_dir, "--role", "worker", output=data_dir / "stderr.log")
    status = node.wait_ready(120)      # control.json written and GET /v1/status answered
    node.signal(signal.SIGTERM); node.wait(30)
    stop_all([node, ...])              # SIGTERM to all, one shared grace period, then SIGKILL

Ownership: a supervisor ends only the children it started, by the PID it holds (the ``Popen`` handle),
never by name. The child's stdout and stderr go to one ``output`` file (0600: logs name peers and
addresses); the node's own log goes wherever its ``--log-file`` says. :meth:`NodeProcess.restart` runs
the same command again once the child has ended (a node restarted on its data dir after a crash: with a
fixed ``--listen`` it keeps its address), its output appended to the same file.

Warm starts: given a ``starter`` (``node/warmstart.py``), a child that runs this interpreter's console
script or ``-m module`` is forked from a server that imported torch, libp2p and the node once, instead of
exec'd; the demo and the tests start their nodes so. What the supervisor holds and does is the same (the
PID, signals, the exit code); a server that cannot start means an exec'd child and a warning.

Network namespaces (Linux, root): ``netns="NS"`` runs the child as ``ip netns exec NS ...``, which execs,
so the PID held is still the node's own; its control API listens on that namespace's loopback, so
:meth:`NodeProcess.status` asks it from inside the namespace (:func:`http_get_in`). The namespaces
themselves are the test harness's (``testing/netns.py``).

Dying with the parent: a parent killed with SIGKILL (or by the OOM killer) runs no clean-up, so on Linux
each child asks the kernel for SIGTERM when its parent goes (``prctl(PR_SET_PDEATHSIG)``, set between
fork and exec, see :func:`die_with_parent`). The kernel sends it when the *thread* that started the child
ends, so start children from a thread that lives as long as they should (the main thread; never from
``asyncio.to_thread``). Elsewhere there is no such request: a clean stop still ends every child.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from intellect_node.errors import ConfigError, IntellectNodeError, TransportError

if TYPE_CHECKING:
    from intellect_node.node.warmstart import WarmChild, WarmStarter

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
"""How long children get between SIGTERM and SIGKILL (a node's own clean stop is bounded at 20 s)."""
KILL_WAIT_S = 10.0
"""How long to wait for a SIGKILLed child to be reaped (the kernel's side; seconds on a loaded host)."""
READY_POLL_S = 0.1
"""Between looks for ``control.json`` while a child starts (a start takes seconds: torch, libp2p)."""
PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""
CLONE_NEWNET = 0x40000000
"""From <linux/sched.h>: setns(2) into a network namespace."""


def cli_argv() -> list[str]:
    """How to run ``intellect-node``: the console script next to this interpreter when there is one
    (what an operator runs), else ``python -m intellect_node.cli`` with this interpreter."""
    exe = Path(sys.executable).with_name("intellect-node")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "intellect_node.cli"]


def child_env(extra: Mapping[str, str] | None = None, *, drop_prefix: str = "") -> dict[str, str]:
    """This process's environment for a child: one torch thread per process (several nodes share the
    machine's cores), variables starting with ``drop_prefix`` left out (a self-contained swarm does not
    take the operator's ``INTELLECT_NODE_*`` settings), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not (drop_prefix and k.startswith(drop_prefix))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when the parent dies; None elsewhere (or
    where libc has no ``prctl``).

    The C function is looked up here, in the parent: between fork and exec a child of a threaded parent
    (the libp2p thread, the dashboard) may only make plain system calls, no ``dlopen`` and no imports
    that could wait on a lock another thread held at fork. If the parent died before the request was
    made, the signal would never come: the child sees it has been re-parented and exits at once."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, sigterm = os.getpid(), int(signal.SIGTERM)

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, sigterm)
        if os.getppid() != parent:
            os._exit(1)
    return in_child


def write_config(path: Path, doc: Mapping[str, Mapping[str, object]]) -> Path:
    """Write a node config file (``--config``, or ``<data-dir>/config.toml``) from ``{section: {field:
    value}}``. Values are written as JSON, which TOML reads the same for the strings, numbers, booleans
    and lists a config holds; a mapping value becomes its own table (``[rl.env_args]``). The file is
    checked by the node that reads it (``config/.py``)."""
    lines: list[str] = []

    def table(name: str, values: Mapping[str, object]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, Mapping))
        lines.append("")
        for k, v in values.items():
            if isinstance(v, Mapping):
                table(f"{name}.{k}", v)

    for section, values in doc.items():
        table(section, values)
    path.write_text("\n".join(lines))
    return path


def http_get_in(ns: str, url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> bytes:
    """GET ``url`` from inside network namespace ``ns`` (e.g. a node's control API on the namespace's
    loopback).

    A fresh thread joins the namespace with setns(2) (network namespaces are per thread on Linux) and
    does the request; the calling process itself stays where it is. Much cheaper than running a CLI in
    the namespace (a Python start-up each, seconds on a loaded 2-core machine)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                        timeout=timeout) as resp:
                out["body"] = resp.read()
        except BaseException as exc:  # handed to the caller's thread below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout + 5)
    if "error" in out:
        raise out["error"]
    if "body" not in out:
        raise TimeoutError(f"GET {url} in {ns} did not finish within {timeout + 5}s")
    return bytes(out["body"])


def _open_output(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


class NodeProcess:
    """One child process running a node (``intellect-node join``, ``sweep worker``, a test's own node
    module) with data dir ``data_dir``; started on construction. ``proc`` is the ``Popen`` handle.

    ``output``: the child's stdout and stderr (appended). ``log_file``: the node's own log, if it was
    given one (``--log-file``), shown in :meth:`death_note`. ``new_session``: the child gets a session of
    its own, so a Ctrl-C at the terminal reaches only the parent, which then stops its children in order.
    ``netns``: the Linux network namespace to run it in (see the module docstring). ``starter``: fork the
    child from that warm server (``node/warmstart.py``) where it can run the command, else start it cold.
    """

    def __init__(self, argv: Sequence[str], data_dir: Path, *, output: Path, name: str = "",
                 env: Mapping[str, str] | None = None, cwd: Path | None = None, log_file: Path | None = None,
                 new_session: bool = False, netns: str | None = None,
                 starter: WarmStarter | None = None) -> None:
        self.argv = list(argv)
        self.data_dir = data_dir
        self.name = name or data_dir.name
        self.output = output
        self.log_file = log_file
        self.netns = netns
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._new_session = new_session
        self._starter = starter
        data_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | WarmChild = self._spawn()

    def _spawn(self) -> "subprocess.Popen[bytes] | WarmChild":
        if self._starter is not None and self.netns is None and self._starter.runs(self.argv):
            self.output.parent.mkdir(parents=True, exist_ok=True)
            try:
                return self._starter.start(self.argv, output=self.output, env=self._env, cwd=self._cwd,
                                           new_session=self._new_session)
            except (OSError, EOFError) as exc:  # no server (a sandbox without fork or sockets): exec
                log.warning("could not fork %s from the warm server (%s): starting it cold", self.name, exc)
        argv = ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else self.argv
        out = _open_output(self.output)
        try:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self._env,
                cwd=str(self._cwd) if self._cwd else None, start_new_session=self._new_session,
                preexec_fn=die_with_parent())
        finally:
            out.close()  # the child holds its own descriptor

    def restart(self) -> None:
        """Run the same command again (same data dir, environment and namespace, output appended) once
        the child has ended: a node restarted on its own state, e.g. after a SIGKILL."""
        if self.alive():
            raise IntellectNodeError(f"{self.name} still runs (PID {self.pid}): end it before a restart")
        self.proc = self._spawn()

    @classmethod
    def join(cls, data_dir: Path, *args: str, output: Path, **kw: Any) -> "NodeProcess":
        """``intellect-node join --headless --data-dir DATA_DIR *args`` (JSON log lines, no dashboard)."""
        return cls([*cli_argv(), "join", "--headless", "--data-dir", str(data_dir), *args], data_dir,
                   output=output, **kw)

    # -- state ---------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The node's ``GET /v1/status`` answer (its control API); ConfigError when it does not answer."""
        from intellect_node.node import control

        if self.netns is None:
            return dict(control.request(self.data_dir, "GET", "/v1/status", timeout=timeout))
        url, token = control.read_control_file(self.data_dir)
        try:
            body = http_get_in(self.netns, url + "/v1/status", {"Authorization": f"Bearer {token}"},
                               timeout=timeout)
        except urllib.error.HTTPError as exc:
            raise TransportError(f"node answered {exc.code} to GET /v1/status in {self.netns}") from exc
        except OSError as exc:  # refused, reset, timed out: not (or no longer) up
            raise ConfigError(f"the node of --data-dir {self.data_dir} does not answer at {url} in network "
                              f"namespace {self.netns} ({exc})", field="data_dir") from exc
        return dict(json.loads(body))

    @property
    def peer_id(self) -> str:
        return str(self.status()["peer_id"])

    def addr(self) -> str:
        """The node's first listen address (what others bootstrap from)."""
        return str(self.status()["listen_addrs"][0])

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait until the node is up (``control.json`` written and its status answered) and return the
        status; IntellectNodeError, with the child's last words, if it exits or ``timeout`` s pass."""
        from intellect_node.node import control

        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise IntellectNodeError(self.death_note())
            if (self.data_dir / control.CONTROL_FILE).exists():
                try:
                    return self.status()
                except IntellectNodeError:
                    pass  # written but not answering yet
            if time.monotonic() > deadline:
                raise IntellectNodeError(f"{self.name} did not start within {timeout:.0f}s; log:\n"
                                         f"{self.log_tail()}")
            time.sleep(READY_POLL_S)

    # -- signals -------------------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child (by PID) if it still runs."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, up to ``grace`` s for a clean exit, then SIGKILL; the exit code (None if killed)."""
        return stop_all([self], grace)[0]

    def kill(self) -> None:
        """SIGKILL now (tests and benches tearing down: nothing of the child's is kept)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(KILL_WAIT_S)

    # -- what it said --------------------------------------------------------------------------------

    def output_text(self, chars: int = 4000) -> str:
        """The end of the child's stdout/stderr."""
        try:
            return self.output.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        """The end of the node's own log (``log_file``), else of its output."""
        if self.log_file is None:
            return self.output_text()
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def death_note(self) -> str:
        """Why the child is gone, for the operator: exit code, its last output, where its logs are."""
        tail = self.output_text(2000)
        return (f"{self.name} exited with code {self.proc.poll()}.\n{tail or self.log_tail()}\n"
                f"(logs in {self.data_dir})")


def stop_all(nodes: Iterable[NodeProcess], grace: float = STOP_GRACE_S) -> list[int | None]:
    """Stop children in the order given: SIGTERM to every one first (they stop in parallel), then one
    shared ``grace`` period, then SIGKILL for any still there. Exit codes in the same order; None for a
    child that had to be killed."""
    nodes = list(nodes)
    for node in nodes:
        node.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    codes: list[int | None] = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            node.kill()
            codes.append(None)
    return codes
