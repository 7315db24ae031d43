#!/usr/bin/env python
"""Scale benchmark: N idle role-less nodes on 127.0.0.1, what each costs and how fast the swarm answers.

A node's idle cost must not grow with the swarm. For each N (``--nodes 4,8,16,32,48``)
this starts N real ``intellect-node join --headless`` processes (no role, default network settings,
each in its own data dir under one temp dir, through the product's supervisor ``node/processes.py``),
in waves of ``--wave`` started together, each wave waited for before the next (two cores cannot start
48 Python processes at once in anything like their idle start time). Node 0 bootstraps from nobody,
node i from node 0 and one random earlier node. Then, per N:

- start-up: spawn to the first ``GET /v1/status`` answer (0.1 s polls) and the node's own ``ready``
  mark (``snapshot.timeline``, seconds from its process start as the kernel records it), p50/p95;
- settle: connections per node polled every ``SETTLE_POLL_S`` until two polls agree (bounded);
- idle CPU per node, as a share of one core, from ``/proc/<pid>/stat`` (utime+stime) over a
  ``--window`` s window in which the bench sends nothing; RSS from ``/proc/<pid>/status``; heartbeats
  delivered per node per second over the same window (``gossip.delivered`` of the heartbeat topic,
  deliveries after de-duplication): the figure ``bench/scale_model.py`` predicts;
- connections per node (``/v1/status`` ``peers``), max and mean, against the high watermark;
- gossip reach: a probe node in this process (the product's ``Swarm``, its own key, bootstrapped to
  three nodes, subscribed to the heartbeat topic) publishes a signed heartbeat built by the product's
  ``Heartbeats.beat``; each node's peerbook records when it heard it (``known_peers`` ->
  ``last_heartbeat_age_s``: receipt = the middle of the status request minus that age, uncertain by
  half the request's round trip, printed). Reach time = publish to the moment 99% of the N nodes heard
  it (for N < 100, every node); median and worst of ``--reach-rounds`` heartbeats;
- provider lookups: a 256 KiB blob ``put`` on node 0 (returns once its provider record is out), then
  ``blob get`` on ``--lookups`` other nodes one after the other; lookup latency = request to the
  ``manifest`` event (the provider walk, the provider's URL from its heartbeat, one loopback HTTP GET of
  the manifest), p50/p95. Nodes that fetched provide the blob too, as they do in a real swarm.

Every wait is bounded in count and time; a node that dies ends the run with its last words. Only the
PIDs this bench started are signalled (``stop_all``). Figures are printed beside the issue's aims as
ratios (figure / aim: under 1 meets an "under" aim). ``--simulate`` also prints the message-rate model
(``bench/scale_model.py``) for 100 to 10,000 nodes and checks it against the heartbeat rates measured.

Run (while holding the shared machine's bench lock):

    flock /work/tmp/bench.lock .venv/bin/python bench/scale.py --nodes 4,8,16,32,48 --simulate
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUN_ID = "bench-scale"
AIM_CPU = 0.01
"""Aim: idle CPU per node under 1% of one core (and flat from 4 to 48 nodes)."""
AIM_REACH_S = 2.0
"""Aim: a gossip message reaches 99% of 48 nodes in under 2 s."""
AIM_LOOKUP_P95_S = 1.0
"""Aim: provider lookups p95 under 1 s at 48 nodes."""
AIM_START_S = 2.0
"""Aim: a node starts in under 2 s."""
START_TIMEOUT_S = 120.0
"""Per wave: two cores starting a wave beside 40 idle nodes take seconds, never minutes."""
SETTLE_POLL_S = 3.0
SETTLE_MAX_POLLS = 40
"""Polls before measuring anyway (see :func:`settle`)."""
REACH_TIMEOUT_S = 20.0
REACH_POLL_S = 0.2
LOOKUP_TIMEOUT_S = 60.0
BLOB_BYTES = 256 * 1024
STATUS_THREADS = 8
STATUS_TIMEOUT_S = 20.0
STATUS_TRIES = 3
"""A status request on a saturated machine (48 nodes on 2 cores) can take seconds; bounded all the same."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _env() -> dict[str, str]:
    from intellect_node.node.processes import child_env

    return child_env({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, drop_prefix="INTELLECT_NODE_")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1), nearest rank: the value at or under which ``q`` of them lie."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


# -- /proc -------------------------------------------------------------------------------------------

def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (``/proc/<pid>/stat`` fields 14 and 15)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces
    return int(fields[11]) + int(fields[12])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- nodes ---------------------------------------------------------------------------------------------

@dataclass
class Node:
    proc: Any  # NodeProcess
    spawned: float  # time.monotonic() at spawn
    ready_s: float | None = None  # spawn -> first status answer (outside view)
    own_ready_s: float | None = None  # the node's own timeline mark
    addr: str = ""
    peer_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _config(data_dir: Path, bootstrap: list[str]) -> None:
    from intellect_node.node.processes import write_config

    network: dict[str, Any] = {"listen": ["/ip4/127.0.0.1/tcp/0"], "http_host": "127.0.0.1"}
    if bootstrap:
        network["bootstrap"] = bootstrap
    write_config(data_dir / "config.toml", {"network": network, "metrics": {"enabled": False},
                                            "run": {"run_id": RUN_ID}})


def _spawn(work: Path, i: int, bootstrap: list[str]) -> Node:
    from intellect_node.node.processes import NodeProcess

    d = work / f"n{i:03d}"
    d.mkdir(parents=True)
    _config(d, bootstrap)
    proc = NodeProcess.join(d, output=work / f"n{i:03d}.log", env=_env(), cwd=REPO)
    return Node(proc, time.monotonic())


def _wait_wave(wave: list[Node]) -> None:
    """Poll every node of the wave until each answers status (bounded); record its start-up times."""
    from intellect_node.errors import IntellectNodeError
    from intellect_node.node import control

    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(wave)
    while pending:
        for node in list(pending):
            if not node.proc.alive():
                raise SystemExit(node.proc.death_note())
            if not (node.proc.data_dir / control.CONTROL_FILE).exists():
                continue
            try:
                st = node.proc.status()
            except IntellectNodeError:
                continue  # written, not answering yet
            node.ready_s = time.monotonic() - node.spawned
            node.own_ready_s = st["snapshot"]["timeline"]["ready"]
            node.extra["first_peer_s"] = st["snapshot"]["timeline"]["first_peer"]
            node.addr, node.peer_id = st["listen_addrs"][0], st["peer_id"]
            pending.remove(node)
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"{len(pending)} nodes did not start within {START_TIMEOUT_S:.0f} s; "
                             f"last words:\n{pending[0].proc.output_text(1500)}")
        time.sleep(0.1)


def start_swarm(work: Path, n: int, wave_size: int, rng: random.Random, nodes: list[Node]) -> None:
    """Start ``n`` nodes in waves into ``nodes`` (the caller stops them, even after a failure)."""
    while len(nodes) < n:
        first = len(nodes)
        size = 1 if first == 0 else min(wave_size, n - first)
        wave = []
        for i in range(first, first + size):
            boot = [] if i == 0 else list(dict.fromkeys([nodes[0].addr, nodes[rng.randrange(first)].addr]))
            wave.append(_spawn(work, i, boot))
        nodes.extend(wave)
        _wait_wave(wave)


def statuses(nodes: list[Node], pool: ThreadPoolExecutor) -> list[tuple[float, float, dict[str, Any]]]:
    """Every node's status with the wall-clock times just before and after its request."""
    from intellect_node.errors import IntellectNodeError

    def one(node: Node) -> tuple[float, float, dict[str, Any]]:
        for attempt in range(STATUS_TRIES):
            if not node.proc.alive():
                raise SystemExit(node.proc.death_note())
            t0 = time.time()
            try:
                st = node.proc.status(timeout=STATUS_TIMEOUT_S)
            except IntellectNodeError:  # a node starved of CPU answers late; a dead one is caught above
                if attempt == STATUS_TRIES - 1:
                    raise
                continue
            return t0, time.time(), st
        raise AssertionError("unreachable")
    return list(pool.map(one, nodes))


def _heartbeat_settled(st: dict[str, Any], n: int) -> bool:
    """The node beats at the interval its rule gives for the whole swarm (it grows towards it at most
    doubling per beat, so it lags the swarm's growth by a few beats). Nodes whose status has no
    ``heartbeats`` (before the interval stretched with the swarm) beat at a fixed interval."""
    hb = st.get("heartbeats")
    if not hb or hb.get("fixed_rate"):
        return True
    from intellect_node.config.schema import NetworkConfig
    from intellect_node.p2p.heartbeat import stretched_interval

    net = NetworkConfig()
    target = stretched_interval(hb["base_interval_s"], n, stretch_above=net.heartbeat_stretch_above,
                                max_interval=net.heartbeat_max_interval)
    return bool(hb["interval_s"] >= target * 0.999)


def settle(nodes: list[Node], pool: ThreadPoolExecutor) -> tuple[int, list[dict[str, Any]]]:
    """Poll until every node has heard every other one and beats at the interval its rule gives for the
    swarm, and two consecutive polls show the same connections everywhere; (polls, last statuses)."""
    last: list[Any] = []
    for polls in range(1, SETTLE_MAX_POLLS + 1):
        sts = [s for _, _, s in statuses(nodes, pool)]
        conns = [sorted(s["peers"]) for s in sts]
        if (conns == last and all(len(s["alive_peers"]) >= len(nodes) - 1 for s in sts)
                and all(_heartbeat_settled(s, len(nodes)) for s in sts)):
            return polls, sts
        last = conns
        time.sleep(SETTLE_POLL_S)
    print(f"  (not settled after {SETTLE_MAX_POLLS} polls {SETTLE_POLL_S:.0f} s apart; measuring anyway)")
    return SETTLE_MAX_POLLS, sts


def idle_window(nodes: list[Node], window: float, hb_topic: str,
                before: list[dict[str, Any]], pool: ThreadPoolExecutor) -> dict[str, Any]:
    """CPU, RSS and heartbeat deliveries per node over ``window`` s of the bench doing nothing."""
    load0 = os.getloadavg()
    t0 = time.monotonic()
    ticks0 = [cpu_ticks(nd.proc.pid) for nd in nodes]
    hb0 = [s["gossip"]["delivered"].get(hb_topic, 0) for s in before]
    time.sleep(window)  # the measurement window itself: nothing is asked of the nodes meanwhile
    ticks1 = [cpu_ticks(nd.proc.pid) for nd in nodes]
    elapsed = time.monotonic() - t0
    load1 = os.getloadavg()
    after = [s for _, _, s in statuses(nodes, pool)]
    hb1 = [s["gossip"]["delivered"].get(hb_topic, 0) for s in after]
    # the status poll after the window adds a few ms to the deliveries' span; negligible against 30 s
    cpu = [(b - a) / CLK_TCK / elapsed for a, b in zip(ticks0, ticks1)]
    hb_rate = [(b - a) / elapsed for a, b in zip(hb0, hb1)]
    conns = [len(s["peers"]) for s in after]
    high = after[0]["connections"].get("high")
    return {"cpu_share": cpu, "rss_mib": [rss_mib(nd.proc.pid) for nd in nodes], "hb_per_s": hb_rate,
            "connections": conns, "conn_high": high, "conn_low": after[0]["connections"].get("low"),
            "alive_peers": [len(s["alive_peers"]) for s in after],
            "hb_interval_s": [s.get("heartbeats", {}).get("interval_s") for s in after],
            "trims": sum(s["connections"].get("trims", 0) for s in after),
            "window_s": elapsed, "load": [load0[0], load1[0]]}


# -- gossip reach ----------------------------------------------------------------------------------------

async def reach(work: Path, nodes: list[Node], rounds: int, pool: ThreadPoolExecutor) -> dict[str, Any]:
    """Publish ``rounds`` heartbeats from an in-process probe node; when did each node hear each one?"""
    from intellect_node.config.schema import NetworkConfig
    from intellect_node.p2p.heartbeat import Heartbeats
    from intellect_node.p2p.swarm import Swarm
    from intellect_node.protocol.signing import SigningKey

    swarm = await Swarm.start(SigningKey.generate(), run_id=RUN_ID, listen=["/ip4/127.0.0.1/tcp/0"])
    try:
        net = NetworkConfig()  # an ordinary node's heartbeat; beat() only, no loops started
        hb = Heartbeats(swarm, interval=net.heartbeat_interval, peer_timeout=net.peer_timeout)
        swarm.subscribe(hb.topic, lambda data, origin: data, lambda msg, origin: None)
        picks = (nodes[0], nodes[len(nodes) // 2], nodes[-1])
        await swarm.bootstrap(list(dict.fromkeys(nd.addr for nd in picks)))
        deadline = time.monotonic() + REACH_TIMEOUT_S
        while not swarm.mesh_peers(hb.topic):
            if time.monotonic() > deadline:
                raise SystemExit(f"the probe joined no heartbeat mesh within {REACH_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        per_round: list[dict[str, Any]] = []
        for _ in range(rounds):
            published = time.time()
            await swarm.publish(hb.topic, hb.beat())
            heard: dict[int, float] = {}
            slack = 0.0
            deadline = time.monotonic() + REACH_TIMEOUT_S
            while len(heard) < len(nodes) and time.monotonic() < deadline:
                await asyncio.sleep(REACH_POLL_S)
                todo = [i for i in range(len(nodes)) if i not in heard]
                got = await loop.run_in_executor(None, statuses, [nodes[i] for i in todo], pool)
                for i, (t0, t1, st) in zip(todo, got):
                    rec = next((p for p in st["known_peers"] if p["peer_id"] == swarm.peer_id), None)
                    age = None if rec is None else rec["last_heartbeat_age_s"]
                    if age is None:
                        continue
                    at = (t0 + t1) / 2 - age
                    if at >= published - (t1 - t0) / 2 - 0.002:  # this round's heartbeat, not the last
                        heard[i] = max(0.0, at - published)
                        slack = max(slack, (t1 - t0) / 2)
            delays = sorted(heard.values())
            need = math.ceil(0.99 * len(nodes))
            per_round.append({"reached": len(heard), "of": len(nodes),
                              "reach99_s": delays[need - 1] if len(delays) >= need else None,
                              "median_s": statistics.median(delays) if delays else None,
                              "uncertainty_s": slack})
        return {"rounds": per_round, "probe_mesh": len(swarm.mesh_peers(hb.topic))}
    finally:
        await swarm.close()


# -- provider lookups -------------------------------------------------------------------------------------

def _stream(data_dir: Path, path: str, body: dict[str, Any], timeout: float) -> Any:
    """POST to a node's control API and yield ``(seconds since the request, event)`` per NDJSON line."""
    from intellect_node.node import control

    url, token = control.read_control_file(data_dir)
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            if line.strip():
                yield time.monotonic() - t0, json.loads(line)


def lookups(work: Path, nodes: list[Node], count: int, rng: random.Random) -> dict[str, Any]:
    from intellect_node.node import control

    src = work / "blob.bin"
    src.write_bytes(rng.randbytes(BLOB_BYTES))
    t0 = time.monotonic()
    put = control.request(nodes[0].proc.data_dir, "POST", "/v1/blob/put", {"path": str(src)},
                          timeout=LOOKUP_TIMEOUT_S)
    put_s = time.monotonic() - t0
    askers = rng.sample(range(1, len(nodes)), min(count, len(nodes) - 1))
    found, total, errors = [], [], []
    for i in askers:
        manifest_at = None
        try:
            for at, ev in _stream(nodes[i].proc.data_dir, "/v1/blob/get", {"cid": put["cid"], "out": None},
                                  LOOKUP_TIMEOUT_S):
                if ev["event"] == "manifest" and manifest_at is None:
                    manifest_at = at
                elif ev["event"] == "error":
                    errors.append(ev.get("message", "")[:200])
                elif ev["event"] == "done":
                    total.append(at)
                if manifest_at is None and at > LOOKUP_TIMEOUT_S:
                    break  # leaving ends the node's fetch; counted as a failed lookup
        except OSError as exc:  # no line for LOOKUP_TIMEOUT_S (a read timeout), or the node went away
            errors.append(f"node {i}: {type(exc).__name__}: {exc}"[:200])
        if manifest_at is not None:
            found.append(manifest_at)
    return {"put_s": put_s, "lookup_s": found, "failed": len(askers) - len(found), "get_total_s": total,
            "errors": errors, "asked": len(askers)}


# -- one swarm -------------------------------------------------------------------------------------------

def late_joiners(work: Path, nodes: list[Node], count: int, rng: random.Random) -> list[Node]:
    """Start ``count`` more nodes one at a time into the settled swarm: start-up without a wave beside it
    (the caller stops them with the rest)."""
    joined = []
    for _ in range(count):
        i = len(nodes)
        node = _spawn(work, i, list(dict.fromkeys([nodes[0].addr, nodes[rng.randrange(i)].addr])))
        nodes.append(node)
        _wait_wave([node])
        joined.append(node)
    return joined


def run_swarm(root: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    from intellect_node.node.processes import stop_all
    from intellect_node.protocol.topics import topic

    work = root / f"swarm{n}"
    work.mkdir(parents=True)
    rng = random.Random(n)
    nodes: list[Node] = []
    pool = ThreadPoolExecutor(STATUS_THREADS)
    try:
        t_start = time.monotonic()
        start_swarm(work, n, args.wave, rng, nodes)
        started_s = time.monotonic() - t_start
        t_settle = time.monotonic()
        polls, sts = settle(nodes, pool)
        settle_s = time.monotonic() - t_settle
        if args.quiet > 0:  # steady state: start-up work that backs off (relay searches) has backed off
            time.sleep(args.quiet)
            sts = [s for _, _, s in statuses(nodes, pool)]
        idle = idle_window(nodes, args.window, topic(RUN_ID, "heartbeat"), sts, pool)
        gossip = asyncio.run(reach(work, nodes, args.reach_rounds, pool))
        look = lookups(work, nodes, args.lookups, rng) if n > 1 else {"lookup_s": [], "asked": 0}
        late = late_joiners(work, nodes, args.joiners, rng)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        stop_all([nd.proc for nd in nodes], 20.0)
    return {"n": n, "start_all_s": started_s, "settle_polls": polls, "settle_s": settle_s,
            "ready_s": [nd.ready_s for nd in nodes[:n]], "own_ready_s": [nd.own_ready_s for nd in nodes[:n]],
            "first_peer_s": [nd.extra.get("first_peer_s") for nd in nodes[:n]],
            "late_ready_s": [nd.ready_s for nd in late], "late_own_ready_s": [nd.own_ready_s for nd in late],
            "idle": idle, "reach": gossip, "lookups": look}


# -- report ------------------------------------------------------------------------------------------------

def summary(r: dict[str, Any]) -> dict[str, Any]:
    idle, look = r["idle"], r["lookups"]
    attempts = look["lookup_s"] + [math.inf] * look.get("failed", 0)
    reach99 = [x["reach99_s"] for x in r["reach"]["rounds"] if x["reach99_s"] is not None]
    return {
        "n": r["n"],
        "start_p50": pct(r["ready_s"], 0.5), "start_p95": pct(r["ready_s"], 0.95),
        "own_p50": pct(r["own_ready_s"], 0.5), "own_p95": pct(r["own_ready_s"], 0.95),
        "late_max": max(r["late_ready_s"]) if r["late_ready_s"] else None,
        "late_med": statistics.median(r["late_ready_s"]) if r["late_ready_s"] else None,
        "cpu_mean": statistics.fmean(idle["cpu_share"]), "cpu_max": max(idle["cpu_share"]),
        "rss_mean": statistics.fmean(idle["rss_mib"]), "rss_max": max(idle["rss_mib"]),
        "conn_mean": statistics.fmean(idle["connections"]), "conn_max": max(idle["connections"]),
        "conn_high": idle["conn_high"], "conn_low": idle["conn_low"],
        "hb_per_s": statistics.fmean(idle["hb_per_s"]),
        "alive_mean": statistics.fmean(idle["alive_peers"]),
        "reach99_med": statistics.median(reach99) if reach99 else None,
        "reach99_max": max(reach99) if reach99 else None,
        "reached_all": all(x["reached"] == x["of"] for x in r["reach"]["rounds"]),
        "reach_unc": max(x["uncertainty_s"] for x in r["reach"]["rounds"]),
        # a lookup that found nothing within LOOKUP_TIMEOUT_S counts as infinitely slow
        "lookup_p50": pct(attempts, 0.5) if attempts else None,
        "lookup_p95": pct(attempts, 0.95) if attempts else None,
        "lookups": f"{len(look['lookup_s'])}/{look['asked']}",
        "load": idle["load"], "start_all_s": r["start_all_s"],
    }


def _fig(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f">{LOOKUP_TIMEOUT_S:.0f}" if math.isinf(value) else f"{value:.2f}"


def _ratio(value: float | None, aim: float) -> str:
    if value is None:
        return "n/a"
    return "inf" if math.isinf(value) else f"{value / aim:.2f}"


def report(rows: list[dict[str, Any]]) -> None:
    print("\nscale: N idle role-less nodes on 127.0.0.1")
    head = ("N", "start in waves p50/p95 s", "own ready p50/p95", "lone joiner med/max s",
            "CPU/node mean/max", "RSS MiB mean/max", "conns mean/max (high)", "hb/s/node",
            "reach99 med/max s", "lookup p50/p95 s", "load 1m")
    print(" | ".join(head))
    for s in rows:
        reach = (f"{_fig(s['reach99_med'])}/{_fig(s['reach99_max'])}"
                 + ("" if s["reached_all"] else " (not all)"))
        look = f"{_fig(s['lookup_p50'])}/{_fig(s['lookup_p95'])} ({s['lookups']})"
        print(" | ".join([
            str(s["n"]), f"{s['start_p50']:.2f}/{s['start_p95']:.2f}",
            f"{s['own_p50']:.2f}/{s['own_p95']:.2f}", f"{_fig(s['late_med'])}/{_fig(s['late_max'])}",
            f"{100 * s['cpu_mean']:.2f}%/{100 * s['cpu_max']:.2f}%",
            f"{s['rss_mean']:.0f}/{s['rss_max']:.0f}",
            f"{s['conn_mean']:.1f}/{s['conn_max']} ({s['conn_high']})", f"{s['hb_per_s']:.2f}", reach, look,
            f"{s['load'][0]:.1f}-{s['load'][1]:.1f}"]))
    print("\nagainst the aims (ratio = figure / aim; at or under 1 meets it):")
    for s in rows:
        print(f"  N={s['n']:3d}: start p95 in waves {_fig(s['start_p95'])} s / {AIM_START_S:.0f} s = "
              f"{_ratio(s['start_p95'], AIM_START_S)}, lone joiner worst {_fig(s['late_max'])} s = "
              f"{_ratio(s['late_max'], AIM_START_S)}; idle CPU max {100 * s['cpu_max']:.2f}% / 1% = "
              f"{_ratio(s['cpu_max'], AIM_CPU)}; connections max {s['conn_max']} / high {s['conn_high']} = "
              f"{_ratio(s['conn_max'], s['conn_high'] or 1)}; reach99 worst {_fig(s['reach99_max'])} s "
              f"(+/-{s['reach_unc'] * 1000:.0f} ms) / {AIM_REACH_S:.0f} s = "
              f"{_ratio(s['reach99_max'], AIM_REACH_S)}"
              f"; lookup p95 {_fig(s['lookup_p95'])} s / {AIM_LOOKUP_P95_S:.0f} s = "
              f"{_ratio(s['lookup_p95'], AIM_LOOKUP_P95_S)}")
    swarms = [s for s in rows if s["n"] >= 4]  # the aim: flat from 4 nodes on (a lone node hears nobody)
    if len(swarms) > 1:
        first, last = swarms[0], swarms[-1]
        print(f"  flatness (aim 1): CPU per node at N={last['n']} / at N={first['n']} = "
              f"{last['cpu_mean'] / first['cpu_mean']:.2f}; heartbeats per node per s "
              f"{last['hb_per_s'] / first['hb_per_s']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="4,8,16,32,48", help="swarm sizes, comma-separated")
    ap.add_argument("--wave", type=int, default=4, help="nodes started together")
    ap.add_argument("--window", type=float, default=30.0, help="idle measurement window, s")
    ap.add_argument("--quiet", type=float, default=0.0,
                    help="seconds to wait after settling before the idle window (steady state: a node's "
                         "relay searches back off to one in 5 minutes about 330 s after its start)")
    ap.add_argument("--reach-rounds", type=int, default=5, help="probe heartbeats published")
    ap.add_argument("--lookups", type=int, default=12, help="provider lookups, each from another node")
    ap.add_argument("--joiners", type=int, default=3, help="nodes started one at a time after the rest")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs and logs (printed)")
    ap.add_argument("--simulate", action="store_true", help="also print bench/scale_model.py's model")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "scale.json")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        print(f"--nodes {args.nodes!r}: give swarm sizes of at least 1, comma-separated (e.g. 4,8,16)",
              file=sys.stderr)
        sys.exit(2)
    if args.wave < 1 or args.window <= 0 or args.reach_rounds < 1 or args.lookups < 1 or args.joiners < 0:
        print("--wave, --reach-rounds and --lookups must be at least 1, --joiners at least 0, --window "
              "above 0", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    # The probe's libp2p logs (connections its close resets) go to a file, not between the figures.
    logging.basicConfig(filename=root / "bench.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raw, rows = [], []
    try:
        for n in sizes:
            print(f"N={n}: starting in waves of {args.wave} (load {os.getloadavg()[0]:.1f})", flush=True)
            r = run_swarm(root, n, args)
            raw.append(r)
            rows.append(summary(r))
            s = rows[-1]
            print(f"  started in {s['start_all_s']:.0f} s, settled in {r['settle_s']:.0f} s; idle CPU "
                  f"{100 * s['cpu_mean']:.2f}% per node (max {100 * s['cpu_max']:.2f}%), RSS "
                  f"{s['rss_mean']:.0f} MiB, connections {s['conn_mean']:.1f} (max {s['conn_max']}), "
                  f"heartbeats {s['hb_per_s']:.2f}/s; "
                  f"reach99 {_fig(s['reach99_med'])} s; lookup p95 {_fig(s['lookup_p95'])} s", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)  # what is measured so far survives a failure
            args.out.write_text(json.dumps({"runs": raw, "summary": rows}, indent=2))
    finally:
        if args.keep:
            print(f"data dirs and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(rows)
    model = None
    if args.simulate:
        from bench import scale_model

        model = scale_model.main_report(measured={s["n"]: s["hb_per_s"] for s in rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": raw, "summary": rows, "model": model}, indent=2))


if __name__ == "__main__":
    main()
