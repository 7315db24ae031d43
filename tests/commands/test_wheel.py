"""The built wheel, installed into a fresh venv and run from outside the checkout: the embedded model is in
it (the checkout's assets, byte for byte), `model eval` runs it, and `join --headless --role worker` starts
a node that `status` reaches. The installed console script runs `--version`, `model eval` and `join`
(the node starting while the others run); `keys init` and the commands that only talk to the installed
node (`status`, `stop`) run in this process (``tests.support.cli.invoke_cli``).

The fresh venv has no pip and no packages of its own; the project's dependencies come from the test
environment's site-packages through a `.pth` line (a plain path entry: that directory's own `.pth` files,
among them the checkout's editable-install hook, are not run), so only the wheel provides
`intellect_node`. The test checks that the module it runs is the installed copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.cli import invoke_cli
from tests.support.common import REPO
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow  # a wheel build, a venv and a node start: about 30 s here


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv}: {r.stdout}\n{r.stderr}"
    return r.stdout


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INTELLECT_NODE_", "PYTHONPATH"))}
    env["OMP_NUM_THREADS"] = "1"
    # the tracked sources, copied: the build writes build/ and *.egg-info beside them, not in the checkout
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w",
          str(dist)], tmp_path, env)
    wheel = next(dist.glob("intellect_node-*.whl"))

    venv = tmp_path / "venv"
    _run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)  # type: ignore[attr-defined]  # CPython's, not in typeshed
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path, env).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], tmp_path, env)

    cli = venv / "bin" / "intellect-node"
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(py), "-c", "import intellect_node; print(intellect_node.__file__)"], work, env)
    assert where.startswith(str(site)), where
    keys = invoke_cli("keys", "init", "--data-dir", str(tmp_path / "trainer"))
    assert keys.returncode == 0, keys.stderr[-2000:]
    trainer_id = keys.stdout.split()[-1]

    # the node starts while the other commands run
    d = tmp_path / "node"
    proc = subprocess.Popen([str(cli), "join", "--headless", "--data-dir", str(d), "--role", "worker",
                             "--trainer-peer-id", trainer_id], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "join.err", "wb"))
    try:
        assert _run([str(cli), "--version"], work, env).startswith("intellect-node ")
        # the same embedded model (and every other asset) as the checkout's, byte for byte ...
        assets = {p.relative_to(src): p.read_bytes() for p in (src / "intellect_node" / "assets").rglob("*")
                  if p.is_file()}
        assert any(rel.name == "model.safetensors" for rel in assets), sorted(map(str, assets))
        assert {p.relative_to(site): p.read_bytes() for p in (site / "intellect_node" / "assets").rglob("*")
                if p.is_file()} == assets
        # ... and it runs from the wheel: weights, tokenizer and chat template through the torch engine
        evaluated = _run([str(cli), "model", "eval", "--n", "8"], work, env)
        assert "pass" in evaluated.lower(), evaluated
        wait_for(lambda: proc.poll() is not None or (d / "control.json").exists(), 120,
                 what="the installed node's control.json")
        assert proc.poll() is None, (tmp_path / "join.err").read_text()[-2000:]
        status = invoke_cli("status", "--data-dir", str(d), "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        st = json.loads(status.stdout)
        assert st["peer_id"].startswith("12D3KooW") and st["health"]["state"] in ("running", "degraded")
        assert st["roles"] == ["worker"] and st["worker"]["policy_version"] == -1  # waiting for a trainer
        stop = invoke_cli("stop", "--data-dir", str(d))
        assert stop.returncode == 0 and "stopped" in stop.stdout and proc.wait(30) == 0, stop.stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
