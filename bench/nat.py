"""Reachability benchmark on a network-namespace topology (Linux, root, iproute2, iptables).

Measures, in one run:
- time to reachability of a private node joining (first relay reservation held and advertised, found
  through the DHT) beside a public node's time to a PUBLIC AutoNAT verdict;
- blob chunk throughput over libp2p streams (``/intellect/blob-chunk/1.0.0``, hash-checked) on a direct
  connection between public hosts (the baseline), through a relay (private to private, one behind a
  port-randomising NAT, so the punch fails), and over a connection punched by DCUtR through
  port-preserving NATs;
- the time DCUtR took to give a direct connection.

Each figure is printed beside its baseline from the same run as a ratio. Nodes are
intellect_node/testing/nat_agent.py processes; the topology is intellect_node/testing/netns.py's.

    sudo .venv/bin/python bench/nat.py [--mib 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from intellect_node.testing.netns import Agent, Topology, netns_unavailable_reason  # noqa: E402

CHUNK = 4 * 1024 * 1024


T = TypeVar("T")


def until(fn: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def throughput(fetcher: Agent, server: Agent, mib: int) -> tuple[float, list[str]]:
    cids = server.call("put", size=CHUNK, n=max(1, mib * 1024 * 1024 // CHUNK), timeout=60)["cids"]
    r = fetcher.call("fetch", peer=server.peer_id, cids=cids, timeout=300)
    return r["bytes"] / r["seconds"] / 2**20, r["kinds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16, help="MiB moved per throughput measurement")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    reason = netns_unavailable_reason()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    logs = Path(tempfile.mkdtemp(prefix="natbench-"))
    with Topology(n_public=3, nats=(True, True, False), log_dir=logs) as topo:
        relay = ["--relay", "--max-bytes", str(1 << 30)]
        pubs = [topo.agent(ns, f"pub{k}", "--name", f"pub{k}", "--ip", topo.public_ip(k), "--public",
                           *(relay if k else [])) for k, ns in enumerate(topo.public_ns)]
        privs = [topo.agent(ns, f"priv{j}", "--name", f"priv{j}", "--ip", topo.private_ip(j), "--dcutr")
                 for j, ns in enumerate(topo.private_ns)]
        for a in pubs + privs:
            a.wait_ready()
        boot = pubs[0].addrs[0]

        # Time to reachability. Public baseline: connect to the bootstrap node, ask for an AutoNAT verdict.
        servers = [p.peer_id for p in pubs]
        t0 = time.monotonic()
        pubs[2].call("connect", addr=boot)
        pubs[2].call("connect", addr=pubs[1].addrs[0])
        verdict = pubs[2].call("autonat", servers=servers[:2])
        t_public = time.monotonic() - t0
        assert verdict["status"] == "PUBLIC", verdict
        t_private = []
        for a in privs:
            t0 = time.monotonic()
            a.call("connect", addr=boot)
            a.call("relay_client", want=2, check_interval=0.2)
            until(lambda: a.call("relay_state")["circuit_addrs"], 120, f"{a.name} to hold a reservation")
            t_private.append(time.monotonic() - t0)

        # Throughput: direct (public to public) baseline, relayed (port-randomising NAT), punched.
        direct, relayed, punched, punch_s = [], [], [], []
        pubs[0].call("connect", addr=pubs[2].addrs[0])
        # Relayed: a private fetcher (a public one would get a direct connection: the private node
        # dials out to it) and a server behind the port-randomising NAT (the punch fails).
        privs[0].call("dial", addrs=privs[2].call("relay_state")["circuit_addrs"])
        privs[0].call("dial", addrs=privs[1].call("relay_state")["circuit_addrs"])
        punch = privs[0].call("punch", peer=privs[1].peer_id, timeout=90)
        if not punch["direct"]:
            raise SystemExit(f"DCUtR did not give a direct connection: {punch}")
        punch_s.append(punch["seconds"])
        for _ in range(args.repeats):
            mbps, kinds = throughput(pubs[0], pubs[2], args.mib)
            assert kinds == ["direct"], kinds
            direct.append(mbps)
            mbps, kinds = throughput(privs[0], privs[2], args.mib)
            assert kinds == ["relayed"], kinds
            relayed.append(mbps)
            mbps, kinds = throughput(privs[0], privs[1], args.mib)
            assert "direct" in kinds, kinds
            punched.append(mbps)

    med = statistics.median
    print(f"nat benchmark ({args.mib} MiB per transfer, median of {args.repeats}; logs in {logs})")
    print(f"time to reachability  public (AutoNAT PUBLIC)        {t_public:6.2f} s   (baseline)")
    for j, t in enumerate(t_private):
        print(f"                      private{j} (relay reserved)      {t:6.2f} s   x{t / t_public:.2f}")
    print(f"DCUtR to direct       port-preserving NATs          {punch_s[0]:6.2f} s")
    print(f"chunk throughput      direct public-public          {med(direct):6.1f} MiB/s (baseline)")
    print(f"                      relayed (randomising NAT)     {med(relayed):6.1f} MiB/s "
          f"x{med(relayed) / med(direct):.2f}")
    print(f"                      punched (DCUtR)               {med(punched):6.1f} MiB/s "
          f"x{med(punched) / med(direct):.2f}")


if __name__ == "__main__":
    main()
