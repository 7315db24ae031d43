"""A child for tests/node/test_warmstart.py: says where and how it runs, then exits with ``argv[1]``.

Run as ``python -m tests.support.warm_probe CODE``: prints its PID, session, argv, working directory,
``PROBE`` from its environment, what stdin gives and its name (``/proc``), as one JSON line; an atexit
handler prints ``bye``. A code of ``wait`` sleeps until it is signalled."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys

atexit.register(lambda: print("bye", flush=True))
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
                  "probe": os.environ.get("PROBE"), "stdin": sys.stdin.read(), "name": __name__,
                  "comm": open(f"/proc/{os.getpid()}/comm").read().strip()}), flush=True)
if sys.argv[1] == "wait":
    signal.pause()
sys.exit(int(sys.argv[1]))
