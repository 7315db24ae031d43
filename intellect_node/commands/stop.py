"""``intellect-node stop``: ask the node running with a data dir to stop, and wait until it has.

How it finds the node: ``control.json`` (URL, token, PID; written once the node is up, removed when it
stops) and the data-dir lock ``node.lock`` (held by a node from the moment it starts until its last
step of stopping). The request goes to ``POST /v1/stop`` on the control API: the same clean stop as
SIGTERM, asked with the token, so only someone who can read the data dir can ask. When the control API
does not answer (a node still starting, or one whose event loop hangs) the node gets SIGTERM, by PID,
but only a PID known to hold the lock: a ``control.json`` left behind by a killed node may name a PID
that now belongs to another program.

"Stopped" means the lock is free (the node closes it after everything else, see
``node/runtime.py``) and the process has gone. Exit codes: 0 stopped, 3 no node was running (LSB's
"program is not running"), 1 it did not stop within ``--timeout`` (its PID is printed).
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path
from typing import Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import IntellectNodeError

EXIT_NOT_RUNNING = 3
STOP_WAIT_S = 60.0
"""Default wait: a node's own clean stop is bounded at 20 s (``STOP_TIMEOUT_S``) plus start-up it may
have to finish first (loading a model) before it looks at the request."""
POLL_S = 0.1


def lock_path(d: Path) -> Path:
    from intellect_node.node.runtime import LOCK_FILE

    return d / LOCK_FILE


def lock_held(d: Path) -> bool:
    """Whether a process holds the data-dir lock (tried without waiting, released at once)."""
    try:
        fd = os.open(lock_path(d), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock if we took it
    return False


def lock_holders(d: Path) -> set[int]:
    """PIDs holding ``flock`` locks on the data dir's lock file, from ``/proc/locks`` (Linux); an empty
    set where that file does not exist. How the CLI checks that a PID is really the node's."""
    try:
        st = os.stat(lock_path(d))
        text = Path("/proc/locks").read_text()
    except OSError:
        return set()
    # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:131 0 EOF"; a waiter's line has "->" after the number
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out: set[int] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
            out.add(int(parts[4]))
    return out


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        return stat_line.rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no /proc: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, not ours to signal
    return True


def _control_pid(d: Path) -> int | None:
    import json

    from intellect_node.node.control import CONTROL_FILE, MAX_CONTROL_FILE

    try:
        pid = json.loads((d / CONTROL_FILE).read_bytes()[:MAX_CONTROL_FILE]).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and pid > 1 else None


def stop_node(d: Path, timeout: float) -> tuple[str, int | None]:
    """Ask the node of ``d`` to stop and wait. Returns ``(how, pid)``: how is ``"control"`` (asked over
    the control API), ``"signal"`` (SIGTERM) or ``"none"`` (nothing ran). IntellectNodeError if it is
    still there after ``timeout`` s."""
    from intellect_node.node import control

    pid = _control_pid(d)
    holders = lock_holders(d)
    if holders and pid not in holders:
        pid = None  # a stale control.json's PID may be another program's by now
    if not lock_held(d):
        if (d / control.CONTROL_FILE).exists():  # a node killed with SIGKILL never removed it
            (d / control.CONTROL_FILE).unlink(missing_ok=True)
        return "none", None
    how = "control"
    try:
        control.request(d, "POST", "/v1/stop", timeout=5.0)
    except IntellectNodeError:  # starting (no control.json yet) or not answering: SIGTERM by PID
        holders = lock_holders(d)
        target = pid if pid in holders else (next(iter(holders)) if len(holders) == 1 else None)
        if target is None:
            raise IntellectNodeError(
                f"a node holds {lock_path(d)} but its control API does not answer and its PID cannot be "
                "told (no /proc/locks here); stop it with `kill <pid>` or your service manager") from None
        pid = target
        how = "signal"
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while lock_held(d) or (pid is not None and pid_alive(pid)):
        if time.monotonic() > deadline:
            raise IntellectNodeError(f"the node (pid {pid or '?'}) of --data-dir {d} is still running after "
                                     f"{timeout:.0f} s; see `intellect-node logs --data-dir {d}`, or end it "
                                     f"with `kill -KILL {pid or '<pid>'}`")
        time.sleep(POLL_S)
    return how, pid


def register(app: typer.Typer) -> None:
    @app.command("stop")
    def stop(
        data_dir_opt: Optional[Path] = DataDirOption,
        timeout: float = typer.Option(STOP_WAIT_S, "--timeout", min=0.1,
                                      help="Seconds to wait for the node to exit."),
    ) -> None:
        """Stop the node running with this data dir (a clean stop, as SIGTERM) and wait until it exited.

        Exit code 0 when it stopped, 3 when no node was running, 1 when it is still running after
        --timeout. Under systemd use `systemctl stop intellect-node` instead (or systemd restarts it)."""
        d = data_dir(data_dir_opt)
        t0 = time.monotonic()
        try:
            how, pid = stop_node(d, timeout)
        except IntellectNodeError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        if how == "none":
            typer.echo(f"no node is running with --data-dir {d}", err=True)
            raise typer.Exit(EXIT_NOT_RUNNING)
        by = "SIGTERM" if how == "signal" else "its control API"
        typer.echo(f"stopped the node (pid {pid or '?'}) of {d} via {by} in {time.monotonic() - t0:.1f} s")
