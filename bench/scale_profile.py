#!/usr/bin/env python
r"""Where an idle node's CPU goes, and what it sends and receives per connected peer.

Starts ``--nodes`` idle role-less nodes exactly as ``bench/scale.py`` does (same waves, bootstrap and
settle rule), but each with the bench-only probe ``bench/scale_probe/sitecustomize.py`` (counters of
pubsub RPCs by kind, Noise messages with their yamux frame type, streams by protocol). Once settled it
takes one ``--window`` s window in which the bench asks nothing and prints, per node and second, and per
connected peer and second, what the nodes sent and received, averaged over all nodes; with ``--py-spy``
it also samples one node (the middle one) with py-spy over the same window (GIL-holding samples,
``--gil``) and prints the share of samples under each of a fixed list of code areas.

The probe's wrappers cost a little CPU of their own, so this bench's CPU figure is not the one to quote:
``bench/scale.py`` measures CPU without the probe.

    flock /work/tmp/bench.lock .venv/bin/python bench/scale_profile.py --nodes 16 \
        --py-spy /tmp/pyspy/bin/py-spy
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import scale  # noqa: E402  (bench/scale.py: the same swarm, settle rule and CPU reading)

PROBE = REPO / "bench" / "scale_probe"

AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("signed peer record (build, check, store)", ("peer/envelope.py", "peer/peer_record.py",
                                                  "env_to_send_in_RPC", "consume_peer_record",
                                                  "maybe_consume_signed_record")),
    ("Noise encrypt/decrypt and framing", ("security/noise/",)),
    ("yamux", ("stream_muxer/yamux/",)),
    ("Kademlia", ("kad_dht/",)),
    ("gossipsub router", ("pubsub/gossipsub.py", "pubsub/mcache.py", "pubsub/score.py")),
    ("pubsub (streams, validation, rpc queue)", ("pubsub/",)),
    ("identify / ping", ("identity/", "host/ping.py")),
    ("multistream / network", ("protocol_muxer/", "network/")),
    ("our code (intellect_node)", ("intellect_node/",)),
    ("asyncio / aiohttp", ("asyncio/", "aiohttp/")),
    ("trio scheduler / io", ("trio/",)),
)
"""Each sample is charged to the first area any frame of its stack matches, innermost frame first."""


def probe_env(out_dir: Path) -> dict[str, str]:
    from intellect_node.node.processes import child_env

    return child_env({"PYTHONPATH": f"{PROBE}{os.pathsep}{REPO}", "PYTHONUNBUFFERED": "1",
                      "SCALE_PROBE_DIR": str(out_dir)}, drop_prefix="INTELLECT_NODE_")


def read_probe(out_dir: Path, pid: int) -> dict[str, Any]:
    probe: dict[str, Any] = json.loads((out_dir / f"{pid}.json").read_text())
    return probe


def area_of(stack: str) -> str:
    frames = stack.split(";")[::-1]  # innermost first
    for frame in frames:
        for name, needles in AREAS:
            if any(n in frame for n in needles):
                return name
    return "other"


def py_spy_shares(collapsed: Path) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, share per area, share per innermost library function: the top 25)."""
    by_area: collections.Counter[str] = collections.Counter()
    by_leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        k = int(n)
        total += k
        by_area[area_of(stack)] += k
        by_leaf[stack.split(";")[-1]] += k
    def share(c: collections.Counter[str], top: int) -> list[tuple[str, float]]:
        return [(name, k / max(1, total)) for name, k in c.most_common(top)]
    return total, share(by_area, 20), share(by_leaf, 25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--wave", type=int, default=4)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--py-spy", default="", help="path of a py-spy binary: also sample the middle node")
    ap.add_argument("--no-probe", action="store_true",
                    help="nodes without the probe (its wrappers take a share of the samples): py-spy only")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "scale_profile.json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="scale-profile-"))
    probe_dir = root / "probe"
    probe_dir.mkdir()
    if not args.no_probe:
        scale._env = lambda: probe_env(probe_dir)  # the nodes start probed
    nodes: list[scale.Node] = []
    rng = random.Random(17)
    try:
        from intellect_node.node.processes import stop_all

        print(f"N={args.nodes}: starting (load {os.getloadavg()[0]:.1f})", flush=True)
        scale.start_swarm(root, args.nodes, args.wave, rng, nodes)
        with ThreadPoolExecutor(scale.STATUS_THREADS) as pool:
            polls, _ = scale.settle(nodes, pool)
            print(f"  settled after {polls} polls; window {args.window:.0f} s", flush=True)
            time.sleep(2.5)  # a fresh probe dump after the last status poll
            load0 = os.getloadavg()[0]
            first: list[dict[str, Any]] = [
                read_probe(probe_dir, nd.proc.pid) if not args.no_probe else {"t": 0.0, "counts": {}}
                for nd in nodes]
            ticks0 = [scale.cpu_ticks(nd.proc.pid) for nd in nodes]
            t0 = time.monotonic()
            spy = None
            target = nodes[len(nodes) // 2]
            collapsed = root / "py-spy.txt"
            if args.py_spy:
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(target.proc.pid), "--gil",
                                        "--rate", "200", "--duration", str(int(args.window)),
                                        "--format", "raw", "--output", str(collapsed), "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(args.window)
            time.sleep(2.5)  # the probes' next dump covers the whole window
            elapsed = time.monotonic() - t0
            ticks1 = [scale.cpu_ticks(nd.proc.pid) for nd in nodes]
            last: list[dict[str, Any]] = [
                read_probe(probe_dir, nd.proc.pid) if not args.no_probe else {"t": 1.0, "counts": {}}
                for nd in nodes]
            load1 = os.getloadavg()[0]
            sts = [s for _, _, s in scale.statuses(nodes, pool)]
            if spy is not None:
                _, err = spy.communicate(timeout=60)
                if spy.returncode != 0:
                    print(f"  py-spy failed: {err.decode(errors='replace')[-500:]}")
                    spy = None
        conns = [len(s["peers"]) for s in sts]
        rates: collections.Counter[str] = collections.Counter()
        per_peer: collections.Counter[str] = collections.Counter()
        for a, b, c in zip(first, last, conns):
            dt = b["t"] - a["t"]
            for key in set(a["counts"]) | set(b["counts"]):
                r = (b["counts"].get(key, 0) - a["counts"].get(key, 0)) / dt
                rates[key] += r / len(nodes)
                per_peer[key] += r / max(1, c) / len(nodes)
        cpu = [(t1 - t0_) / scale.CLK_TCK / elapsed for t0_, t1 in zip(ticks0, ticks1)]
        print(f"  connections {sum(conns) / len(conns):.1f}/node, CPU{'' if args.no_probe else ' (probed)'} "
              f"{100 * sum(cpu) / len(cpu):.2f}% per node, load {load0:.1f}-{load1:.1f}")
        print(f"  {'what (mean over nodes)':<44} {'/node/s':>9} {'/peer/s':>9}")
        for key in sorted(rates):
            if rates[key] >= 0.005:
                print(f"  {key:<44} {rates[key]:>9.3f} {per_peer[key]:>9.3f}")
        result: dict[str, Any] = {"nodes": args.nodes, "connections": conns, "cpu_share_probed": cpu,
                                  "load": [load0, load1], "per_node_s": dict(rates),
                                  "per_peer_s": dict(per_peer)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if spy is not None:
            total, areas, leaves = py_spy_shares(collapsed)
            print(f"  py-spy, node {target.proc.pid} (GIL-holding samples: {total}):")
            for name, s in areas:
                print(f"    {100 * s:5.1f}%  {name}")
            print("  innermost functions:")
            for name, s in leaves:
                print(f"    {100 * s:5.1f}%  {name}")
            result["py_spy"] = {"samples": total, "areas": areas, "leaves": leaves}
            (root / "py-spy.txt").replace(args.out.with_suffix(".collapsed.txt"))
        args.out.write_text(json.dumps(result, indent=1))
        print(f"  written {args.out}")
    finally:
        from intellect_node.node.processes import stop_all

        stop_all([nd.proc for nd in nodes], grace=10.0)
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
