#!/usr/bin/env python
"""Message-rate model: what one idle node of an N-node swarm receives per second, for N up to 10,000.

``bench/scale.py`` measures real swarms of up to 48 processes; two cores will not hold hundreds. This
model counts the messages of the same protocols for larger N from the product's own parameters: the
rules and defaults are imported (``p2p/heartbeat.py``'s ``stretched_interval``, ``NetworkConfig``'s
defaults, ``p2p/host.py``'s lookup bounds) and the gossipsub parameters are read from a live host
(``Swarm.start`` on 127.0.0.1: its ``GossipSub`` object's mesh degrees, heartbeat and gossip window,
and the library's own IHAVE peer count), so the model follows the code when either changes.

Per node, steady state, no role (what the benchmark runs), one line per protocol:

- heartbeats delivered: the sum over the other nodes of 1 / their mean period. A node stretches its
  interval to ``base * n / stretch_above`` once it counts more than ``stretch_above`` stretching nodes
  (capped at ``max_interval``) and sleeps up to ``JITTER`` of it less (a mean period of
  ``interval * (1 - JITTER / 2)``); the run's trainer and validators beat at the base interval
  (``--fixed`` of them). This is what ``scale.py`` measures (``gossip.delivered``), the check below.
- gossip copies: gossipsub forwards each new message to every mesh peer but the one it came from, so a
  node receives each message from up to D mesh peers (D copies, the first delivered, the rest dropped
  as duplicates): an upper bound of D x the swarm-wide message rate.
- IHAVE: every gossip heartbeat (1 s) a node sends one IHAVE to G of its non-mesh subscribed peers
  (py-libp2p: ``max(6 or 8, factor x non-mesh peers)``) listing the message IDs of the last
  ``gossip_window`` heartbeats; by symmetry it receives about G. Its peers are bounded by the
  connection manager (at most ``conn_high``), so G stops growing at ``factor x (conn_high - D)``; the IDs
  per IHAVE follow the swarm-wide message rate.
- DHT routing-table refresh: py-libp2p's maintenance loop every 10 minutes runs a self-lookup and one
  lookup per non-empty k-bucket (about log2(N / k) + 1); a lookup asks about k + alpha x log2(N / k)
  peers (its ALPHA), and its stale-peer pings (5 per 5 minutes at most) only start after an hour of
  silence. By symmetry a node receives what it sends: grows as log^2 N, a few per hour.
- self-lookups of the dialer: only while below ``conn_low`` (N - 1 < conn_low), at most every
  ``DISCOVERY_INTERVAL_S[1]`` once lookups find nobody new; none in a swarm larger than ``conn_low``.
- connection-manager dials: none in a steady swarm; with churn (``--session-s``, the mean time a node
  stays), each departure costs its ~C neighbours one connection and those at ``conn_low`` dial one
  more: C / session dials per node per second, whatever N.
- provider lookups and re-provides: per blob, not per second (they follow the workload): a ``provide``
  is one lookup plus ADD_PROVIDER to k peers, re-provided every 22 h (py-libp2p); a provider lookup asks
  at most ``PROVIDER_WALK_MAX_PEERS``. When every node looks up one blob (a policy checkpoint), the k
  nodes closest to its CID answer ~alpha of N lookups between them: linear in N at those k nodes.

Where the rate is not flat: heartbeats beyond ``stretch_above * max_interval / base`` nodes (7,200 with
the defaults) grow as N / max_interval; IHAVE IDs follow them; DHT maintenance grows as log^2 N.

Run: ``.venv/bin/python bench/scale_model.py [--sizes 100,1000,10000] [--fixed 2] [--session-s 3600]``
(or ``bench/scale.py --simulate``, which also checks the heartbeat rates against the measured ones).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = (100, 1000, 10_000)


async def _live_gossip_params() -> dict[str, Any]:
    """The gossipsub parameters of a node as the product builds it (one host on 127.0.0.1)."""
    from intellect_node.p2p.swarm import Swarm
    from intellect_node.protocol.signing import SigningKey

    swarm = await Swarm.start(SigningKey.generate(), run_id="scale-model", listen=["/ip4/127.0.0.1/tcp/0"])
    try:
        gs = swarm.p2p.gossipsub

        def ihave_peers(non_mesh: int) -> int:
            # the library's own rule (private, read-only): max(Dlazy, factor x candidates) on a fresh host
            return int(gs._get_adaptive_gossip_peers_count("t", non_mesh))

        return {"D": gs.degree, "D_low": gs.degree_low, "D_high": gs.degree_high,
                "gossip_heartbeat_s": float(gs.heartbeat_interval), "gossip_window": gs.mcache.window_size,
                "ihave_peers": {k: ihave_peers(k) for k in range(0, 10_001)}}
    finally:
        await swarm.close()


def params() -> dict[str, Any]:
    from libp2p.kad_dht import common as kad_common
    from libp2p.kad_dht import kad_dht, provider_store

    from intellect_node.config.schema import NetworkConfig
    from intellect_node.p2p import heartbeat, host

    net = NetworkConfig()
    p = asyncio.run(_live_gossip_params())
    p.update({
        "base": net.heartbeat_interval, "stretch_above": net.heartbeat_stretch_above,
        "max_interval": max(net.heartbeat_interval, net.heartbeat_max_interval),
        "conn_low": net.conn_low, "conn_high": net.conn_high,
        "k": kad_common.BUCKET_SIZE, "alpha_lib": kad_common.ALPHA, "alpha": host.ALPHA,
        "rt_refresh_s": kad_dht.ROUTING_TABLE_REFRESH_INTERVAL,
        "reprovide_s": provider_store.PROVIDER_RECORD_REPUBLISH_INTERVAL,
        "walk_max": host.PROVIDER_WALK_MAX_PEERS, "discovery_max_s": host.DISCOVERY_INTERVAL_S[1],
        "stretched_interval": heartbeat.stretched_interval, "jitter": heartbeat.JITTER,
    })
    return p


def heartbeat_rate(p: dict[str, Any], n: int, fixed: int) -> tuple[float, float]:
    """(heartbeats delivered per s at a role-less node, the swarm-wide heartbeat rate), ``fixed`` of the
    ``n`` nodes being trainer/validators at the base interval."""
    stretching = n - fixed
    interval = p["stretched_interval"](p["base"], stretching, stretch_above=p["stretch_above"],
                                       max_interval=p["max_interval"])
    # a node sleeps a uniform 0..JITTER fraction less than the interval it announced
    period, base = interval * (1 - p["jitter"] / 2), p["base"] * (1 - p["jitter"] / 2)
    swarm_rate = stretching / period + fixed / base
    return swarm_rate - 1 / period, swarm_rate  # a node does not deliver its own


def connections(p: dict[str, Any], n: int) -> int:
    """Peers a node holds in a settled idle swarm: all of them while N - 1 <= conn_high, else between
    conn_low and conn_high (the upper bound here)."""
    high: int = p["conn_high"]
    return min(n - 1, high)


def _lookup_queries(p: dict[str, Any], n: int) -> float:
    """Peers one iterative Kademlia lookup asks: about k, plus alpha per halving of the distance beyond."""
    k: float = p["k"]
    alpha: float = p["alpha_lib"]
    return min(n - 1, k + alpha * max(0.0, math.log2(n / k)))


def model_row(p: dict[str, Any], n: int, fixed: int, session_s: float) -> dict[str, float]:
    hb, swarm_rate = heartbeat_rate(p, n, fixed)
    conns = connections(p, n)
    mesh = min(p["D"], conns)
    non_mesh = max(0, conns - mesh)
    g = p["ihave_peers"][min(non_mesh, 10_000)] if non_mesh else 0
    g = min(g, non_mesh)  # cannot gossip to more non-mesh peers than it has
    ihave_per_s = g / p["gossip_heartbeat_s"] if swarm_rate > 0 else 0.0
    ids_per_ihave = min(swarm_rate * p["gossip_window"] * p["gossip_heartbeat_s"], 5000)
    buckets = 1 + max(0.0, math.log2(n / p["k"]))
    dht_per_s = (1 + buckets) * _lookup_queries(p, n) / p["rt_refresh_s"]
    self_lookups = (_lookup_queries(p, n) / p["discovery_max_s"]) if n - 1 < p["conn_low"] else 0.0
    dials = conns / session_s if session_s > 0 else 0.0
    provide_msgs = _lookup_queries(p, n) + p["k"]  # one lookup, then ADD_PROVIDER to the k closest
    lookup_msgs = min(p["walk_max"], _lookup_queries(p, n))
    hot = p["alpha"] * n / p["k"]  # lookups of one blob by every node, at each of the k closest nodes
    return {"n": n, "hb_delivered_per_s": hb, "gossip_copies_per_s": hb * mesh,
            "ihave_per_s": ihave_per_s, "ids_per_ihave": ids_per_ihave, "dht_refresh_per_s": dht_per_s,
            "self_lookup_per_s": self_lookups, "dials_per_s": dials, "connections": conns,
            "total_per_s": hb * mesh + ihave_per_s + dht_per_s + self_lookups + dials,
            "provide_msgs": provide_msgs, "lookup_msgs": lookup_msgs, "hot_lookups_per_blob": hot}


def table(rows: list[dict[str, float]]) -> None:
    print("N | conns | heartbeats delivered/s | gossip copies/s (<= D x) | IHAVE/s (IDs each) | "
          "DHT refresh/s | self-lookups/s | dials/s (churn) | total RPCs/s | "
          "per blob: provide / lookup msgs, at the k closest")
    for r in rows:
        print(f"{r['n']:,} | {r['connections']} | {r['hb_delivered_per_s']:.2f} | "
              f"{r['gossip_copies_per_s']:.1f} | {r['ihave_per_s']:.1f} ({r['ids_per_ihave']:.0f}) | "
              f"{r['dht_refresh_per_s']:.3f} | "
              f"{r['self_lookup_per_s']:.3f} | {r['dials_per_s']:.4f} | {r['total_per_s']:.1f} | "
              f"{r['provide_msgs']:.0f} / {r['lookup_msgs']:.0f}, {r['hot_lookups_per_blob']:.0f}")


def main_report(*, sizes: tuple[int, ...] = SIZES, fixed: int = 2, session_s: float = 3600.0,
                measured: dict[int, float] | None = None) -> dict[str, Any]:
    """Print the model for ``sizes`` (and, with ``measured`` {N: heartbeats delivered per node per s},
    the model beside the measurement for the measured N: those swarms have no trainer or validator)."""
    p = params()
    print(f"\nmodel (product parameters): heartbeat base {p['base']} s, stretch above "
          f"{p['stretch_above']} nodes, max interval {p['max_interval']:.0f} s; gossipsub D={p['D']} "
          f"({p['D_low']}..{p['D_high']}), heartbeat {p['gossip_heartbeat_s']} s, "
          f"window {p['gossip_window']}; "
          f"conn {p['conn_low']}/{p['conn_high']}; Kademlia k={p['k']}, lookup alpha {p['alpha_lib']} "
          f"(library) / {p['alpha']} (our provider walk), refresh {p['rt_refresh_s']} s; {fixed} fixed-rate "
          f"nodes (trainer, validators); churn: mean session {session_s:.0f} s")
    rows = [model_row(p, n, fixed, session_s) for n in sizes]
    table(rows)
    check = []
    if measured:
        print("\nheartbeats delivered per node per s, measured (scale.py, no fixed-rate node) vs model:")
        for n, got in sorted(measured.items()):
            want = heartbeat_rate(p, n, 0)[0]
            check.append({"n": n, "measured": got, "model": want})
            ratio = f"{got / want:.2f}" if want else "n/a"
            print(f"  N={n:3d}: measured {got:.2f}, model {want:.2f}, ratio {ratio}")
    first, last = rows[0], rows[-1]
    print(f"per-node total from N={first['n']:,} to N={last['n']:,}: "
          f"x{last['total_per_s'] / first['total_per_s']:.2f} (N x{last['n'] / first['n']:.0f}); heartbeats "
          f"x{last['hb_delivered_per_s'] / first['hb_delivered_per_s']:.2f}")
    return {"params": {k: v for k, v in p.items() if k not in ("stretched_interval", "ihave_peers")},
            "rows": rows, "check": check}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--fixed", type=int, default=2, help="trainer + validators (beat at the base interval)")
    ap.add_argument("--session-s", type=float, default=3600.0, help="mean time a node stays (churn)")
    args = ap.parse_args()
    try:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= args.fixed or args.fixed < 0 or args.session_s < 0:
        print("--sizes: comma-separated swarm sizes larger than --fixed (>= 0); --session-s >= 0 "
              "(0: no churn)", file=sys.stderr)
        sys.exit(2)
    main_report(sizes=sizes, fixed=args.fixed, session_s=args.session_s)


if __name__ == "__main__":
    main()
