"""NAT traversal on a namespace topology: AutoNAT verdicts, relay reservations (DHT discovery, renewal,
failover), DCUtR through port-preserving NATs, the relay as the path behind a port-randomising NAT, and
chunk transfer that stays inside a relay's byte limit.

Topology (testing/netns.py): pub0 (bootstrap, no relay), pub1..pub3 (relays, reservation TTL 6 s,
4 MiB per circuit), priv0 and priv1 behind port-preserving NATs, priv2 behind a port-randomising NAT;
every NAT drops new inbound connections. Nodes are testing/nat_agent.py processes (real libp2p
hosts running intellect_node.p2p.nat). The tests share one topology and run in file order.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from intellect_node.protocol.ids import cid_of
from intellect_node.testing.netns import Agent, Topology, netns_unavailable_reason
from tests.support.wait import wait_for

RESERVATION_TTL = 6
RELAY_BYTES = 4 * 1024 * 1024
MiB = 1024 * 1024

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(400)]


class Net:
    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.pubs: list[Agent] = []
        self.privs: list[Agent] = []


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Topology(n_public=4, nats=(True, True, False), log_dir=tmp_path_factory.mktemp("natlogs")) as topo:
        n = Net(topo)
        relay_args = ["--relay", "--reservation-ttl", str(RESERVATION_TTL), "--max-bytes", str(RELAY_BYTES)]
        n.pubs = [topo.agent(ns, f"pub{k}", "--name", f"pub{k}", "--ip", topo.public_ip(k), "--public",
                             *(relay_args if k else []))
                  for k, ns in enumerate(topo.public_ns)]
        n.privs = [topo.agent(ns, f"priv{j}", "--name", f"priv{j}", "--ip", topo.private_ip(j), "--dcutr")
                   for j, ns in enumerate(topo.private_ns)]
        for a in n.pubs + n.privs:
            a.wait_ready()
        # Everyone knows only the bootstrap node: relays must be found through the DHT.
        for a in n.pubs[1:] + n.privs:
            a.call("connect", addr=n.pubs[0].addrs[0])
        yield n


def relays_of(a: Agent) -> list[str]:
    return list(a.call("relay_state")["relays"])


def test_private_hosts_find_relays_through_the_dht_reserve_two_and_renew(net: Net) -> None:
    relay_ids = {p.peer_id for p in net.pubs[1:]}
    for a in net.privs:
        a.call("relay_client", want=2, check_interval=0.5)
    for a in net.privs:
        held = wait_for(lambda: (r := relays_of(a)) and len(r) >= 2 and r, 60,
                        what=f"{a.name} to hold 2 reservations", interval=0.25)
        assert held  # wait_for's value is the predicate's, truthy: the relays held
        assert set(held) <= relay_ids, "reservations are made with relays only"
        st = a.call("relay_state")
        # What the node advertises: circuit addresses through its relays, not its unreachable LAN address.
        assert st["addrs"] and all("/p2p-circuit/p2p/" + a.peer_id in x for x in st["addrs"]), st["addrs"]
        assert {x.split("/p2p/")[1].split("/")[0] for x in st["addrs"]} == set(held)
    first = {a.name: a.call("relay_state") for a in net.privs}
    # Renewal before expiry: TTL 6 s, renewed at half of it.
    for a in net.privs:
        before = first[a.name]["renewals"]
        st = wait_for(lambda: (s := a.call("relay_state"))["renewals"] >= before + 2 and s, 20,
                      what=f"{a.name} to renew", interval=0.25)
        assert max(st["expires"]) > max(first[a.name]["expires"]), "renewal extends the reservation"
        assert len(st["relays"]) == 2


def test_autonat_says_public_for_public_hosts_private_behind_nat_or_firewall(net: Net) -> None:
    everyone = net.pubs + net.privs
    for a in everyone:
        for p in net.pubs:
            if p is not a:
                a.call("connect", addr=p.addrs[0])
    servers = [p.peer_id for p in net.pubs]
    for a in net.pubs[1:3]:
        r = a.call("autonat", servers=[s for s in servers if s != a.peer_id])
        assert r["status"] == "PUBLIC", r
        assert r["successes"] >= 2 and r["failures"] == 0
        assert any(net.topo.public_ip(net.pubs.index(a)) in x for x in r["public_addrs"])
    for a in (net.privs[0], net.privs[2]):
        r = a.call("autonat", servers=servers)
        assert r["status"] == "PRIVATE", r
        assert "forward TCP port 4001" in r["fix"] and "a relay is used" in r["fix"], r["fix"]
    # A public host behind a firewall that drops new inbound connections is PRIVATE too.
    pub0 = net.pubs[0]
    net.topo.firewall(net.topo.public_ns[0], True)
    try:
        r = pub0.call("autonat", servers=servers[1:])
        assert r["status"] == "PRIVATE", r
    finally:
        net.topo.firewall(net.topo.public_ns[0], False)
    assert pub0.call("autonat", servers=servers[1:])["status"] == "PUBLIC"


def test_private_host_found_through_dht_then_dcutr_goes_direct(net: Net) -> None:
    priv0, priv1 = net.privs[0], net.privs[1]
    key = cid_of(b"test: a blob priv1 holds")
    priv1.call("provide", key=key, timeout=60)
    found = priv0.call("find", key=key, timeout=60)
    assert priv1.peer_id in found["providers"]
    addrs = found["addrs"][priv1.peer_id]
    assert addrs and all("/p2p-circuit/" in x for x in addrs), addrs
    priv0.call("dial", addrs=addrs)
    assert priv0.call("echo", peer=priv1.peer_id, size=64 * 1024)["kinds"] == ["relayed"]
    cids = priv1.call("put", size=MiB, n=1)["cids"]
    punch = priv0.call("punch", peer=priv1.peer_id, timeout=60)
    assert punch["direct"], punch
    assert "direct" in punch["kinds"]
    fetched = priv0.call("fetch", peer=priv1.peer_id, cids=cids)
    assert fetched["bytes"] == MiB and "direct" in fetched["kinds"]


def test_port_randomising_nat_keeps_the_relay_as_the_path_within_its_byte_limit(net: Net) -> None:
    priv0, priv2, pub0 = net.privs[0], net.privs[2], net.pubs[0]
    circuits = priv2.call("relay_state")["circuit_addrs"]
    priv0.call("dial", addrs=circuits)
    punch = priv0.call("punch", peer=priv2.peer_id, timeout=90)
    assert not punch["direct"] and punch["kinds"] == ["relayed"], punch
    assert priv0.call("echo", peer=priv2.peer_id, size=64 * 1024)["kinds"] == ["relayed"]
    # Chunks over the circuit: the relay allows 4 MiB per circuit, the server spends at most 3/4 of it.
    cids = priv2.call("put", size=MiB, n=3)["cids"]
    got = priv0.call("fetch", peer=priv2.peer_id, cids=cids[:2])
    assert got["bytes"] == 2 * MiB and got["kinds"] == ["relayed"]
    with pytest.raises(AssertionError, match="RelayBudgetExceeded"):
        priv0.call("fetch", peer=priv2.peer_id, cids=cids[2:])
    # Refused before the relay's limit: the circuit is still up and carries traffic.
    assert priv0.call("echo", peer=priv2.peer_id, size=1024)["kinds"] == ["relayed"]
    # A public peer is reached directly: the private node dials out to it (DCUtR's unilateral upgrade).
    pub0.call("dial", addrs=circuits[:1])
    kinds = wait_for(lambda: (k := pub0.call("conns", peer=priv2.peer_id)["kinds"]) and "direct" in k and k,
                     30, what="priv2 to connect directly to public pub0", interval=0.25)
    assert kinds and "direct" in kinds


def test_relay_that_dies_is_replaced_within_bounded_time(net: Net) -> None:
    victim_id = relays_of(net.privs[0])[0]
    victim = next(p for p in net.pubs if p.peer_id == victim_id)
    victim.kill()
    for a in net.privs:  # the bound (30 s, with 0.5 s checks) is the until's deadline
        wait_for(lambda: (r := relays_of(a)) and len(r) == 2 and victim_id not in r, 30,
                 what=f"{a.name} to move its reservation off the dead relay", interval=0.25)
    # The moved reservation works: pub0 reaches priv0 through a new circuit address.
    circuits = net.privs[0].call("relay_state")["circuit_addrs"]
    assert circuits and all(victim_id not in c for c in circuits)
    pub0 = net.pubs[0]
    fresh = next(c for c in circuits if pub0.peer_id not in c)
    pub0.call("dial", addrs=[fresh])
    assert pub0.call("echo", peer=net.privs[0].peer_id, size=1024, timeout=30)["kinds"]  # it answers
