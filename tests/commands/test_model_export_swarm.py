"""``model export --run CID``: the policy a run's trainer announces, fetched by hash through the swarm
(the run fetched and checked as ``join --run`` does), written as a Hugging Face folder. A real trainer
process (the demo's run on the embedded model: keys, config and signed manifest as ``intellect-node demo``
makes them) publishes version 0; a fresh data dir that knows only the trainer's address exports it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from intellect_node.commands.demo import DemoSwarm
from intellect_node.trainer.model import initial_policy
from tests.support.common import run_cli
from tests.support.ports import free_port
from tests.support.roles import ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_announced_policy_is_exported_from_the_swarm(tmp_path: Path) -> None:
    swarm = DemoSwarm(tmp_path / "demo", workers=1, validators=1, run_id="export-run", model=None)
    port = free_port()
    try:
        swarm._spawn(swarm.trainer, [], listen=f"/ip4/127.0.0.1/tcp/{port}")  # the trainer alone
        swarm._wait_ready(swarm.trainer, time.monotonic() + 240)
        boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{swarm.trainer.peer_id}"
        fresh, out = tmp_path / "fresh", tmp_path / "hf"
        r = run_cli("model", "export", "--run", swarm.cid, "--bootstrap", boot, "--data-dir", str(fresh),
                    "--out", str(out), "--timeout", "180", env=ENV, timeout=400)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        doc = json.loads((out / "policy.json").read_text())
        v0 = initial_policy(None, tmp_path / "v0.safetensors")  # what a fresh trainer publishes
        assert doc["version"] == 0 and doc["from"] == "swarm" and doc["policy_hash"] == v0.content_hash
        assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        # only the announced version is handed out: another is the operator's mistake, naming the flag
        r = run_cli("model", "export", "--run", swarm.cid, "--bootstrap", boot, "--data-dir", str(fresh),
                    "--out", str(tmp_path / "other"), "--version", "7", "--timeout", "180", env=ENV,
                    timeout=400)
        assert r.returncode == 2 and "--version 7" in r.stderr, r.stderr[-3000:]
        # what was fetched stays in the data dir: it exports again without the swarm
        r = run_cli("model", "export", "--data-dir", str(fresh), "--out", str(tmp_path / "again"), env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads((tmp_path / "again" / "policy.json").read_text())["policy_hash"] == v0.content_hash
    finally:
        swarm.stop()
