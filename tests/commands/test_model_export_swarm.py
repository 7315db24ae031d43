"""What a demo run gives out through the swarm, with real processes (the demo's run on the embedded model:
keys, config and signed manifest as ``intellect-node demo`` makes them, held-out evaluation on):

- ``model export --run CID``: the policy the trainer announces (version 0), fetched by hash by a fresh
  data dir that knows only the trainer's address (the run fetched and checked as ``join --run`` does),
  written as a Hugging Face folder;
- the held-out figures: the validator evaluates version 0 on the run's held-out problems, ``status`` of
  its data dir shows the result, and ``runs`` on a fresh node lists it (HELD-OUT, the validator as its
  evaluator).

The nodes are real processes; the commands run in this process (``tests.support.cli.invoke_cli``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from intellect_node.commands.demo import DEMO_EVAL, DemoSwarm
from intellect_node.trainer.model import initial_policy
from tests.support.cli import invoke_cli
from tests.support.ports import free_port
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_announced_policy_is_exported_from_the_swarm(tmp_path: Path) -> None:
    swarm = DemoSwarm(tmp_path / "demo", workers=1, validators=1, run_id="export-run", model=None)
    port = free_port()
    validator = next(n for n in swarm.nodes if n.role == "validator")
    try:
        # The trainer and the validator (no worker: the policy stays at version 0), started at once as the
        # demo starts them; the validator dials the trainer until it answers.
        swarm._spawn(swarm.trainer, [], listen=f"/ip4/127.0.0.1/tcp/{port}")
        boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{swarm.trainer.peer_id}"
        swarm._spawn(validator, [boot])
        swarm._wait_ready(swarm.trainer, time.monotonic() + 240)
        fresh, out = tmp_path / "fresh", tmp_path / "hf"
        r = invoke_cli("model", "export", "--run", swarm.cid, "--bootstrap", boot, "--data-dir", str(fresh),
                       "--out", str(out), "--timeout", "180")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        doc = json.loads((out / "policy.json").read_text())
        v0 = initial_policy(None, tmp_path / "v0.safetensors")  # what a fresh trainer publishes
        assert doc["version"] == 0 and doc["from"] == "swarm" and doc["policy_hash"] == v0.content_hash
        assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        # only the announced version is handed out: another is the operator's mistake, naming the flag
        r = invoke_cli("model", "export", "--run", swarm.cid, "--bootstrap", boot, "--data-dir", str(fresh),
                       "--out", str(tmp_path / "other"), "--version", "7", "--timeout", "180")
        assert r.returncode == 2 and "--version 7" in r.stderr, r.stderr[-3000:]
        # what was fetched stays in the data dir: it exports again without the swarm
        r = invoke_cli("model", "export", "--data-dir", str(fresh), "--out", str(tmp_path / "again"))
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads((tmp_path / "again" / "policy.json").read_text())["policy_hash"] == v0.content_hash

        swarm._wait_ready(validator, time.monotonic() + 240)
        assert validator.proc is not None
        proc = validator.proc
        wait_for(lambda: proc.status()["snapshot"]["held_out"]["version"] == 0, timeout=300,
                 interval=1.0, what="the validator's held-out result of v0")
        r = invoke_cli("status", "--data-dir", str(validator.data_dir))
        assert r.returncode == 0 and "held-out    v0: pass rate" in r.stdout, r.stdout[-2000:]

        def listed() -> dict[str, object] | None:
            r = invoke_cli("runs", "--bootstrap", boot, "--json", "--data-dir", str(tmp_path / "lister"))
            assert r.returncode == 0, r.stderr[-3000:]
            (row,) = json.loads(r.stdout)
            held: dict[str, object] | None = row["held_out"]
            return held

        wait_for(lambda: listed() is not None, timeout=180, interval=2.0,
                 what="runs listing a held-out result")
        held = listed()
        assert held is not None and held["version"] == 0 and held["n"] == DEMO_EVAL["eval_problems"]
        assert held["evaluator"] == validator.peer_id
    finally:
        swarm.stop()
