"""A node with no role never imports the ML stack (issue #17: "heavy imports only in the roles that use
them, so a node starts in about a second").

torch alone takes seconds to import on a loaded 2-core machine and hundreds of MB of memory; a relay,
a bootstrap node or an operator's ``status`` has no use for it. The property is easy to lose: one
module-level ``import torch`` in a module the node loads brings it back. So it is checked in fresh
child interpreters (this test process has torch loaded already): once for every module of the layers
a role-less node is built from, and once for what a real ``intellect-node join --headless`` with no
role has loaded when it answers its first status request (lazy imports at start included).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import REPO

HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "reasoning_gym", "math_verify", "vllm")
"""The ML stack: only roles (worker, validator, trainer) and the commands that run a model need it."""

ROLE_LESS = ("intellect_node.protocol", "intellect_node.p2p", "intellect_node.blobs", "intellect_node.node",
             "intellect_node.commands")
"""Packages whose every module a role-less node or the CLI may load (roles/ and the ML layers are what
a ``--role`` adds, imported by ``roles.role_factory`` when one is asked for)."""

IMPORT_ALL = """
import importlib, json, pkgutil, sys
names = ["intellect_node.cli", "intellect_node.dashboard", "intellect_node.logsetup", "intellect_node.roles"]
for pkg in sys.argv[1:]:
    mod = importlib.import_module(pkg)
    found = pkgutil.walk_packages(mod.__path__, pkg + ".")
    names += [m.name for m in found if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": len(names), "modules": sorted(sys.modules)}))
"""

RUN_NODE = """
import json, os, signal, sys, threading, time
from pathlib import Path
from intellect_node.errors import IntellectNodeError
from intellect_node.node import control
d = Path(sys.argv[1])

def report():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            control.request(d, "GET", "/v1/status", timeout=5)
            break
        except IntellectNodeError:  # not up yet: no control.json, or not answering
            time.sleep(0.05)
    (d / "modules.json").write_text(json.dumps(sorted(sys.modules)))
    import gc
    from intellect_node import gcpolicy
    (d / "gc.json").write_text(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                                           "deferred": gcpolicy.deferred()}))
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report, daemon=True).start()
sys.argv = ["intellect-node", "join", "--headless", "--data-dir", str(d), "--metrics-port", "0"]
from intellect_node.cli import main
main()
"""


def _heavy(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_the_modules_of_a_role_less_node_import_no_ml_stack() -> None:
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, *ROLE_LESS], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["imported"] > 50  # the walk found the packages, not an empty list
    assert _heavy(doc["modules"]) == []


@pytest.fixture(scope="module")
def ran_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data dir of a role-less ``intellect-node join --headless`` that ran until its first status
    answer, with what it had loaded (modules.json) and its collector's state (gc.json) then."""
    d = tmp_path_factory.mktemp("startup") / "node"
    out = subprocess.run([sys.executable, "-c", RUN_NODE, str(d)], capture_output=True, text=True,
                         timeout=180, cwd=REPO, env={**_env(), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return d


def test_a_running_role_less_node_has_not_imported_the_ml_stack(ran_node: Path) -> None:
    modules = json.loads((ran_node / "modules.json").read_text())
    assert "libp2p" in modules and "intellect_node.node.runtime" in modules  # it did run a node
    assert _heavy(modules) == []


def _env() -> dict[str, str]:
    """This environment without the operator's node settings (a test node takes only its flags)."""
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("INTELLECT_NODE_")}


def test_a_running_node_collects_garbage_again_with_its_start_up_heap_frozen(ran_node: Path) -> None:
    """The CLI holds the collector off during start-up (intellect_node/gcpolicy.py); by the time the node
    answers, it must be back on (not waiting for the fallback limit) with the start-up heap frozen."""
    state = json.loads((ran_node / "gc.json").read_text())
    assert state == {"enabled": True, "frozen": state["frozen"], "deferred": False}
    assert state["frozen"] > 10_000  # the imported libraries, not a handful of objects
