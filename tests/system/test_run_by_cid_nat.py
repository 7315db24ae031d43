"""A participant behind NAT joins a run by its CID through a relay (root, network namespaces).

The topology (``testing.netns.Topology``): two public hosts on a bridge and one host behind a NAT router
that masquerades and drops new inbound connections.

1. The organiser makes the run on pub0's data dir as the demo does (``commands.run.seal_run``: the
   embedded model's files and the signed manifest as blobs of its store; ``run init``'s own steps are
   tested on loopback in ``test_run_by_cid.py``). Its trainer serves the run with ``join --run CID
   --role trainer`` (relay service on); a validator on pub1 joins by the CID.
2. The participant on priv0 has nothing but the CID and the trainer's address: ``join --run CID --role
   worker --bootstrap ADDR`` makes its key, fetches the manifest and the model files by their hashes,
   starts, finds itself PRIVATE, reserves relay slots, advertises only circuit addresses and a
   ``p2p://`` blob URL, and gets a batch accepted: the validator cannot dial it, so the batch's chunks
   come over the relayed (or hole-punched) libp2p connection.

Asserted on states only: the worker's control API (polled from a thread inside its namespace,
``testing.netns.http_get_in``), the fetched model files against the organiser's, the worker's ledger.
Every process is started by the topology and ended by PID when it closes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from intellect_node.p2p import identity
from intellect_node.testing.netns import Topology, http_get_in, netns_unavailable_reason
from tests.support.common import CLI
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(600)]

PORT = 4001
RL = dict(group_size=8, problems_per_batch=8, groups_per_step=8, max_new_tokens=5, lr=2e-4,
          batches_per_version=1, work_ahead=2)
"""The demo's settings for one worker (``commands.demo.demo_rl(1)``): one batch of 64 five-token
completions of the embedded model is a step."""
NODE_ENV = {
    # Quick checks for a test (production: minutes; docs/nat.md), no metrics server.
    "INTELLECT_NODE_NAT__CHECK_INTERVAL": "5",
    "INTELLECT_NODE_NAT__RELAY_CHECK_INTERVAL": "0.5",
    "INTELLECT_NODE_METRICS__ENABLED": "false",
    "MKL_NUM_THREADS": "1",
}
RELAY_ON = {"INTELLECT_NODE_NAT__RELAY_SERVICE": "on"}
"""The public nodes relay from the start, not only after their AutoNAT verdict (seconds saved)."""
HB = ["--heartbeat-interval", "1", "--peer-timeout", "10"]


class Node:
    """An ``intellect-node`` process in a namespace, and its status through its control API."""

    def __init__(self, topo: Topology, ns: str, name: str, data_dir: Path, args: list[str],
                 env: dict[str, str]) -> None:
        self.topo, self.ns, self.name, self.data_dir = topo, ns, name, data_dir
        self.proc = topo.spawn(ns, name, [CLI, *args], env=env)

    def status(self) -> dict[str, Any]:
        """The control API's status answer ({} until the node is up)."""
        if self.proc.poll() is not None:
            log = self.topo.log_path(self.name).read_text()[-4000:]
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{log}")
        try:
            ctl = json.loads((self.data_dir / "control.json").read_text())
            body = http_get_in(self.ns, ctl["url"] + "/v1/status",
                               {"Authorization": f"Bearer {ctl['token']}"}, timeout=10.0)
        except (OSError, ValueError, KeyError):  # not up yet, or between writes
            return {}
        return dict(json.loads(body))


def make_run(organiser_dir: Path, *, validator: str, bootstrap: str) -> str:
    """The run as the demo makes it (``DemoSwarm._publish``): the embedded model, its thresholds, the
    demo's RL settings; organiser = trainer. Returns the run's CID."""
    from intellect_node.commands.run import model_files, seal_run
    from intellect_node.config.loader import build_config
    from intellect_node.config.run_manifest import run_sections
    from intellect_node.models.loader import embedded_model_dir

    folder = embedded_model_dir()
    key = identity.load_key(organiser_dir)
    cfg = build_config({"run": {"run_id": "nat-run", "trainer_peer_id": key.peer_id,
                                "validator_peer_ids": [validator], "model": str(folder)}, "rl": RL})
    return seal_run(key, organiser_dir, "nat-run", folder, model_files(folder), run_sections(cfg),
                    (folder / "proof_thresholds.json").read_text(), [bootstrap], lambda _line: None)


@pytest.fixture()
def topo(tmp_path: Path) -> Iterator[Topology]:
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Topology(n_public=2, nats=(True,), log_dir=tmp_path / "logs") as t:
        yield t


def nat(st: dict[str, Any]) -> dict[str, Any]:
    return st.get("nat") or {}


def test_a_participant_behind_nat_joins_a_run_by_cid_through_a_relay(topo: Topology, tmp_path: Path) -> None:
    trainer_dir, validator_dir, worker_dir = (tmp_path / n for n in ("trainer", "validator", "worker"))
    organiser = identity.init_key(trainer_dir).peer_id
    validator_id = identity.init_key(validator_dir).peer_id
    boot = f"/ip4/{topo.public_ip(0)}/tcp/{PORT}/p2p/{organiser}"
    cid = make_run(trainer_dir, validator=validator_id, bootstrap=boot)

    def join(ns: str, name: str, d: Path, ip: str, role: str, *extra: str, env: dict[str, str]) -> Node:
        return Node(topo, ns, name, d, ["join", "--run", cid, "--role", role, "--data-dir", str(d),
                                        "--headless", "--listen", f"/ip4/{ip}/tcp/{PORT}", *HB, *extra],
                    {**NODE_ENV, **env})

    # All three start at once (a Python start-up takes seconds here): the validator's and the worker's
    # lookups retry their bootstrap dial until the trainer listens (roles.runs.client_swarm).
    trainer = join(topo.public_ns[0], "trainer", trainer_dir, topo.public_ip(0), "trainer", env=RELAY_ON)
    validator = join(topo.public_ns[1], "validator", validator_dir, topo.public_ip(1), "validator",
                     "--bootstrap", boot, env=RELAY_ON)
    # The participant: no key, no file, only the CID and one address.
    assert not worker_dir.exists()
    worker = join(topo.private_ns[0], "worker", worker_dir, topo.private_ip(0), "worker", "--bootstrap", boot,
                  env={})

    # Behind the NAT: PRIVATE, relay reservations, only circuit addresses, a p2p:// blob URL.
    st = wait_for(lambda: (s := worker.status()) and nat(s).get("reachability") == "PRIVATE"
                  and nat(s).get("relays") and s["listen_addrs"]
                  and all("/p2p-circuit/" in a for a in s["listen_addrs"]) and s, 240,
                  what="the worker to be PRIVATE with a relay reservation, advertising circuit addresses",
                  interval=0.5)
    assert st  # wait_for's value is the predicate's, truthy: the status
    worker_id = identity.load_key(worker_dir).peer_id
    assert st["peer_id"] == worker_id
    assert nat(st)["blob_url"] == f"p2p://{worker_id}"
    assert {r["relay"] for r in nat(st)["relays"]} <= {organiser, validator_id}

    # The manifest and every model file came by hash, byte for byte the organiser's.
    from intellect_node.models.loader import embedded_model_dir
    from intellect_node.protocol.run_manifest import open_run_manifest

    manifest = open_run_manifest((worker_dir / "runs" / f"{cid}.run").read_bytes(), organiser=organiser)
    fetched = worker_dir / "runs" / cid / "model"
    for f in manifest.model_files:
        assert (fetched / f.path).read_bytes() == (embedded_model_dir() / f.path).read_bytes(), f.path

    # A batch accepted: the validator fetched it from a node it cannot dial, over libp2p.
    st = wait_for(lambda: (s := worker.status()) and (s.get("worker") or {}).get("accepted", 0) >= 1 and s,
                  300, what="a batch of the worker accepted", interval=1.0)
    assert st
    assert nat(st)["chunk_stream"]["served_bytes"] > 0, nat(st)
    ledger = st["ledger"]
    assert ledger["rollouts_accepted"] >= RL["group_size"] * RL["problems_per_batch"], ledger
    # The tiny model's first batch is ready before the AutoNAT verdict (5-15 s here); announced with the
    # LAN URL, the validator cannot fetch it ("unavailable", a strike, docs/nat.md). Nothing else.
    assert set(ledger["rejection_reasons"]) <= {"unavailable"}, ledger
    assert trainer.status() and validator.status()  # both still running
