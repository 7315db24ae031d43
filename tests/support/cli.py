"""The ``intellect-node`` command line in this process: ``invoke_cli`` runs one command as the console
script would, without a fresh interpreter per command (each of those imports typer, rich and the
command's libraries again: about a second, more with torch).

It calls :func:`intellect_node.cli.main` itself, so an operator mistake (``ConfigError``) exits 2 with its
message exactly as the installed script does, under click's ``CliRunner.isolation``: ``sys.argv``,
stdin, stdout, stderr and the environment are the command's own for the call and restored after it. The
result has the fields of ``subprocess.run``'s, so a test reads ``returncode``, ``stdout`` and ``stderr``
either way. An exception the command lets out is what the interpreter would make of it: exit 1, the
traceback on stderr.

What it cannot show, and what keeps the real console script (``tests.support.common.run_cli``): that the
script is installed and starts, what a command does to its own process (signals, a node run, exit on
Ctrl-C), and a command whose state outlives the call in the interpreter (the root logger's handlers
and level and the capture of warnings are put back here, and a node command's deferral of the garbage
collector is not applied; nothing else is).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import traceback
from collections.abc import Mapping
from unittest import mock

from typer.testing import CliRunner


def invoke_cli(*args: str, env: Mapping[str, str] | None = None,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``intellect-node *args`` here, ``env`` added to the environment for the call and ``input`` on
    its stdin; its exit code and its output as text."""
    from intellect_node import gcpolicy
    from intellect_node.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    warnings_captured = getattr(logging, "_warnings_showwarning", None) is not None
    argv = sys.argv
    code = 0
    # A node command (join, sweep) holds the garbage collector off for its start-up: not this process's.
    with CliRunner().isolation(input=input, env=dict(env or {})) as (out, err, _), \
            mock.patch.object(gcpolicy, "defer", lambda *a, **k: None):
        sys.argv = ["intellect-node", *args]
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if isinstance(exc.code, str):
                sys.stderr.write(exc.code + "\n")
        except Exception:
            code = 1
            traceback.print_exc(file=sys.stderr)
        finally:
            sys.argv = argv
            sys.stdout.flush()
            sys.stderr.flush()
            for h in root.handlers[:]:  # the command's own (setup_logging's), on the captured stderr
                if h not in handlers:
                    root.removeHandler(h)
                    h.close()
            root.setLevel(level)
            logging.captureWarnings(warnings_captured)
        stdout = out.getvalue().decode("utf-8", "replace")
        stderr = err.getvalue().decode("utf-8", "replace")
    return subprocess.CompletedProcess(["intellect-node", *args], code, stdout, stderr)
