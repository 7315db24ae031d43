"""The real node behind NAT: ``intellect-node join`` processes on a namespace topology (root only).

Three public nodes (pub0 is the bootstrap) and two nodes behind NAT routers that drop new inbound
connections (port-preserving MASQUERADE). Checked end to end through the node's control API and the
CLI: AutoNAT verdicts (PUBLIC with a relay service on the public nodes, PRIVATE with two relay
reservations, only circuit addresses and a ``p2p://`` blob URL on the private ones, the fix text in
``status``), gossip (heartbeats) both ways, a blob held only by a private node found through the DHT
and fetched by a public and by the other private node over libp2p (relayed or punched, per-chunk hash
checks), and a public node's blob fetched by a private node over HTTP.

Status polls go straight to each node's control API from a thread that joins the node's namespace
(``testing.netns.http_get_in``); the CLI runs only where the CLI itself is under test (``status``,
``blob put``/``get``), since every CLI call is a Python start-up.

What made the full node unreliable here before is in docs/nat.md ("Full node behind NAT").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from intellect_node.p2p import identity
from intellect_node.testing.netns import Topology, http_get_in, netns_unavailable_reason
from tests.support.common import CLI
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(420)]

NODE_ENV = {
    # Quick checks for a test; production defaults are minutes (docs/nat.md).
    "INTELLECT_NODE_NAT__CHECK_INTERVAL": "5",
    "INTELLECT_NODE_NAT__RELAY_CHECK_INTERVAL": "0.5",
    "INTELLECT_NODE_METRICS__ENABLED": "false",
}
PORT = 4001


class Node:
    def __init__(self, topo: Topology, ns: str, name: str, ip: str, root: Path,
                 bootstrap: str | None) -> None:
        self.topo, self.ns, self.name = topo, ns, name
        self.data_dir = root / name
        self.data_dir.mkdir(parents=True)
        self.peer_id = identity.init_key(self.data_dir).peer_id
        self.addr = f"/ip4/{ip}/tcp/{PORT}/p2p/{self.peer_id}"
        args = [CLI, "join", "--data-dir", str(self.data_dir), "--headless", "--listen",
                f"/ip4/{ip}/tcp/{PORT}", "--heartbeat-interval", "2", "--log-level", "INFO"]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        self.proc = topo.spawn(ns, name, args, env=NODE_ENV)

    def cli(self, *args: str, timeout: float = 120.0) -> str:
        r = self.topo.run_in(self.ns, [CLI, *args, "--data-dir", str(self.data_dir)], timeout=timeout)
        assert r.returncode == 0, f"{self.name}: {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}"
        return r.stdout

    def status(self) -> dict[str, Any]:
        """The control API's status answer ({} until the node is up)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}; see its log")
        try:
            ctl = json.loads((self.data_dir / "control.json").read_text())
            body = http_get_in(self.ns, ctl["url"] + "/v1/status",
                               {"Authorization": f"Bearer {ctl['token']}"}, timeout=10.0)
        except (OSError, ValueError, KeyError):  # not up yet, or between writes
            return {}
        status: dict[str, Any] = json.loads(body)
        return status


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("natnodes")
    with Topology(n_public=3, nats=(True, True), log_dir=root) as topo:
        out: dict[str, Node] = {}
        # All five start at once (a Python start-up takes 10-30 s here): the others retry their
        # bootstrap dial until pub0 is up (runtime.BOOTSTRAP_RETRY_S).
        out["pub0"] = Node(topo, topo.public_ns[0], "pub0", topo.public_ip(0), root, None)
        for k in (1, 2):
            out[f"pub{k}"] = Node(topo, topo.public_ns[k], f"pub{k}", topo.public_ip(k), root,
                                  out["pub0"].addr)
        for j in (0, 1):
            out[f"priv{j}"] = Node(topo, topo.private_ns[j], f"priv{j}", topo.private_ip(j), root,
                                   out["pub0"].addr)
        yield out


def nat(st: dict[str, Any]) -> dict[str, Any]:
    return st.get("nat") or {}


def test_reachability_relays_gossip_and_blobs_behind_nat(nodes: dict[str, Node], tmp_path: Path) -> None:
    pubs = [nodes[f"pub{k}"] for k in range(3)]
    privs = [nodes["priv0"], nodes["priv1"]]
    # The status board (dashboard, doctor) hears the verdict through the asyncio thread: a moment later.
    for n in pubs:
        wait_for(lambda: (s := n.status()) and nat(s).get("reachability") == "PUBLIC"
                 and "relay_service" in nat(s) and s["snapshot"]["reachability"]["status"] == "public", 180,
                 what=f"{n.name} to be PUBLIC and relaying, on the status board too", interval=0.5)
    for n in privs:
        # Two reservations, and only circuit addresses advertised (status reads an address snapshot).
        st = wait_for(lambda: (s := n.status()) and len(nat(s).get("relays", [])) >= 2 and s["listen_addrs"]
                      and all("/p2p-circuit/" in a for a in s["listen_addrs"])
                      and s["snapshot"]["reachability"]["status"] == "relayed" and s, 150,
                      what=f"{n.name} to hold two relay reservations and advertise only circuit addresses",
                      interval=0.5)
        assert st
        r = nat(st)
        assert r["reachability"] == "PRIVATE", r
        assert f"forward TCP port {PORT}" in r["fix"] and "a relay is used" in r["fix"]
        assert r["blob_url"] == f"p2p://{n.peer_id}"
    # `status` (human) shows the verdict with the fix; `doctor` and the dashboard read the same board.
    out = privs[0].cli("status")
    assert "reachable   PRIVATE via relay" in out and f"forward TCP port {PORT}" in out, out
    # Gossip both ways: the private nodes hear the public ones and each other, and are heard.
    ids = {n.name: n.peer_id for n in pubs + privs}
    wait_for(lambda: {ids["pub1"], ids["priv1"]} <= set(privs[0].status()["alive_peers"]), 90,
             what="priv0 to hear pub1 and priv1", interval=0.5)
    wait_for(lambda: {ids["priv0"], ids["priv1"]} <= set(pubs[2].status()["alive_peers"]), 90,
             what="pub2 to hear both private nodes", interval=0.5)
    # A blob held only by a private node: found through the DHT, fetched over libp2p by a public node.
    src = os.urandom(3 * 1024 * 1024 + 123)
    for_priv = privs[0].data_dir / "in.bin"
    for_priv.write_bytes(src)
    cid = privs[0].cli("blob", "put", str(for_priv), "--chunk-mib", "1").strip().split()[-1]
    out1 = pubs[1].data_dir / "out.bin"
    pubs[1].cli("blob", "get", cid, "--out", str(out1), "--quiet", timeout=180)
    assert out1.read_bytes() == src
    # ... and by the other private node (relayed, or punched through the port-preserving NATs).
    out2 = privs[1].data_dir / "out.bin"
    privs[1].cli("blob", "get", cid, "--out", str(out2), "--quiet", timeout=180)
    assert out2.read_bytes() == src
    served = nat(privs[0].status())["chunk_stream"]["served_bytes"]
    assert served >= len(src), served  # both fetches came from priv0 (the second may also use pub1)
    # A private node fetches a public node's blob over plain HTTP.
    pub_file = pubs[2].data_dir / "in.bin"
    pub_file.write_bytes(os.urandom(1024 * 1024))
    cid2 = pubs[2].cli("blob", "put", str(pub_file)).strip().split()[-1]
    out3 = privs[1].data_dir / "out2.bin"
    privs[1].cli("blob", "get", cid2, "--out", str(out3), "--quiet", timeout=180)
    assert out3.read_bytes() == pub_file.read_bytes()
