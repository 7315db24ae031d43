"""Broadcast over shaped links: one origin and N peers, every host's link limited each way, in namespaces.

Where bench/broadcast.py measures CPU per byte on loopback, this measures what a real swarm runs into:
the origin's uplink. Each host sits in its own network namespace on one bridge
(``intellect_node.testing.netns.Star``), with ``tc`` token-bucket shaping (``tbf``) to ``--rate-mbit``
(100 Mbit/s) on both ends of its veth: its uplink and its downlink. The origin publishes a
``--size-mib`` (256 MiB) checkpoint; N peers fetch it at once. For each N in ``--peers`` (2,4,8):

- ``intellect``: ``intellect_node.blobs.peer`` processes (3 MiB chunks by default, each checked on arrival);
  every peer has the origin and every other peer as providers and serves the verified chunks it holds
  while it downloads (swarming). Time-to-all = the last peer holds every chunk in its store (what a
  node serves and loads from); ``intellect+file`` adds writing the assembled file on every peer.
- ``shardcast``: shardcast 0.3.2, every peer a client of the origin's server (its default layout).
- ``shardcast relay``: shardcast with one of the N peers as its ``MiddleNode`` (the relay it puts
  between the origin and the clients: it pulls the shards from the origin and serves them as they
  land); the other N-1 peers are clients of both the origin and the relay (the client spreads its
  requests by measured bandwidth). Time-to-all includes the relay holding every shard.
- ``bound``: size / link rate, one copy through one link (21.5 s for 256 MiB at 100 Mbit/s). With one
  origin uplink no scheme can beat it: every byte leaves the origin at least once, and every peer
  receives every byte through its own downlink.

Each figure is printed with its ratio to the bound, and intellect against shardcast (the faster of its
two layouts), per N. Outputs are compared with the source's sha2-256 after the timed region. The
intellect line also says how much the origin sent (in copies of the file: 1.00 = each byte left the
origin once) and how many chunks peers took from each other.

Needs root, iproute2 with ``tc``, and shardcast 0.3.2 (``pip install -e '.[bench]'``). Runs hold the
shared bench lock: ``flock /work/tmp/bench.lock .venv/bin/python bench/broadcast_links.py``. Quick
check: ``--size-mib 32 --peers 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.broadcast import MIB, PY, Child, _fetch_all, _make_source, _verify, _wait_all  # noqa: E402
from intellect_node.testing.netns import Star, netns_unavailable_reason  # noqa: E402

HERE = Path(__file__).resolve()
BROADCAST = HERE.with_name("broadcast.py")
SYSTEMS = ("intellect", "shardcast", "shardcast-relay")


class LinkSampler:
    """Bytes through every host's link over time, read from the bridge's ports every ``period`` s: what
    port sK receives is host K's uplink, what it sends is host K's downlink. One ``ip -s -j link`` per
    sample, in a thread, while a transfer runs."""

    def __init__(self, star: Star, period: float = 0.2) -> None:
        self.ns = f"{star.prefix}-br"
        self.hosts = len(star.host_ns)
        self.period = period
        self.samples: list[tuple[float, list[int], list[int]]] = []  # (t, uplink bytes, downlink bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[float, list[int], list[int]]:
        out = subprocess.run(["ip", "-n", self.ns, "-s", "-j", "link", "show"], capture_output=True,
                             text=True, check=True).stdout
        up, down = [0] * self.hosts, [0] * self.hosts
        for link in json.loads(out):
            name = link.get("ifname", "")
            if name.startswith("s") and name[1:].isdigit() and int(name[1:]) < self.hosts:
                k = int(name[1:])
                up[k] = link["stats64"]["rx"]["bytes"]
                down[k] = link["stats64"]["tx"]["bytes"]
        return time.monotonic(), up, down

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self.period)

    def __enter__(self) -> "LinkSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._read())

    def rates(self, k: int, t0: float, bin_s: float = 1.0) -> list[tuple[float, float]]:
        """Host ``k``'s (uplink, downlink) Mbit/s in bins of ``bin_s`` from ``t0``."""
        out: list[tuple[float, float]] = []
        s = [x for x in self.samples if x[0] >= t0 - self.period]
        edge, j = t0 + bin_s, 0
        while s and edge <= s[-1][0] + bin_s / 2:
            a = max((x for x in s if x[0] <= edge - bin_s), key=lambda x: x[0], default=s[0])
            b = max((x for x in s if x[0] <= edge), key=lambda x: x[0], default=s[0])
            dt = (b[0] - a[0]) or 1.0
            out.append(((b[1][k] - a[1][k]) * 8 / dt / 1e6, (b[2][k] - a[2][k]) * 8 / dt / 1e6))
            edge += bin_s
            j += 1
        return out


def _where_time_goes(kids: list[Child], t0: float, elapsed: float, sampler: LinkSampler,
                     rate_mbit: float, n_chunks: int) -> dict[str, Any]:
    """What the chunk events and link samples say: each peer's first and last chunk, the origin's uplink
    utilisation per second, its idle seconds, and how long the last eighth of the chunks took."""
    firsts, lasts, tails = [], [], []
    for k in kids:
        ts = sorted(ev["t"] - t0 for ev in k.skipped if ev.get("event") == "chunk" and "t" in ev)
        if not ts:
            continue
        firsts.append(ts[0])
        lasts.append(ts[-1])
        tails.append(ts[-1] - ts[max(0, len(ts) - max(1, n_chunks // 8))])
    origin = sampler.rates(0, t0)
    up = [u for u, _ in origin][: max(1, round(elapsed))]
    downs = [sum(d for _, d in sampler.rates(k, t0)[: max(1, round(elapsed))]) / max(1, round(elapsed))
             for k in range(1, len(kids) + 1)]
    return {
        "first_chunk_s": [round(x, 2) for x in sorted(firsts)],
        "origin_up_mbit_per_s": [round(u) for u in up],
        "origin_up_mean": sum(up) / len(up),
        "origin_idle_s": sum(1.0 - min(1.0, u / rate_mbit) for u in up),
        "peer_down_mean": sum(downs) / len(downs) if downs else 0.0,
        "tail_s": round(max(tails), 2) if tails else 0.0,
    }


def _in(ns: str, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs: the PID we hold is the program's)."""
    return ["ip", "netns", "exec", ns, *argv]


def run_intellect(star: Star, src: Path, work: Path, n: int, chunk_mib: int, rate_mbit: float,
                  trace: Path | None = None) -> dict[str, Any]:
    root = work / f"intellect-{n}"
    peer = [PY, "-m", "intellect_node.blobs.peer"]
    origin = Child(_in(star.host_ns[0], [*peer, "--root", str(root / "origin"), "--host", star.ip(0)]))
    kids: list[Child] = []
    try:
        hello = origin.read_until({"listening"})
        origin.send({"op": "put", "path": str(src), "chunk_size": chunk_mib * MIB})
        cid = origin.read_until({"put"})["cid"]
        kids = [Child(_in(star.host_ns[k], [*peer, "--root", str(root / f"peer{k}"), "--host", star.ip(k)]))
                for k in range(1, n + 1)]
        hellos = _wait_all(kids, {"listening"})
        everyone = [{"peer_id": h["peer_id"], "http_url": h["url"]} for h in [hello, *hellos]]
        t0 = time.monotonic()
        with LinkSampler(star) as sampler:
            done, elapsed, with_file, _cpu = _fetch_all(kids, cid, everyone, root)
        chunks = -(-src.stat().st_size // (chunk_mib * MIB))
        w = _where_time_goes(kids, t0, elapsed, sampler, rate_mbit, chunks)
        print(f"    first chunk at {w['first_chunk_s']} s; origin uplink {w['origin_up_mean']:.0f} Mbit/s "
              "mean, "
              f"{w['origin_idle_s']:.1f} s idle-equivalent; peer downlinks {w['peer_down_mean']:.0f} Mbit/s "
              f"mean; last eighth of the chunks took up to {w['tail_s']} s\n"
              f"    origin uplink per second: {w['origin_up_mbit_per_s']}", flush=True)
        if trace is not None:  # every chunk event and link sample, for a closer look
            trace.write_text(json.dumps({
                "t0": t0, "elapsed": elapsed, "origin": hello["peer_id"],
                "peers": [{"peer_id": h["peer_id"], "done": d,
                           "chunks": [ev for ev in k.skipped if ev.get("event") == "chunk"]}
                          for h, k, d in zip(hellos, kids, done)],
                "links": sampler.samples}))
        origin.send({"op": "stats"})
        ostats = origin.read_until({"stats"})
        served = ostats["bytes_served"]
        finish = sorted(ev["seconds"] for ev in done)
        print(f"    peers finished at {', '.join(f'{t:.1f}' for t in finish)} s; origin sent chunks "
              f"n times: {ostats['chunks_sent_n_times']}", flush=True)
        from_peers = sum(c for ev in done for p, c in ev["by_provider"].items() if p != hello["peer_id"])
        total = sum(sum(ev["by_provider"].values()) for ev in done)
        dups = sum(ev.get("endgame_requests", 0) for ev in done)
        busy = sum(ev.get("busy_answers", 0) for ev in done)
    finally:
        for k in [*kids, origin]:
            k.close()
    _verify(src, [root / f"out{i}.bin" for i in range(n)])
    shutil.rmtree(root, ignore_errors=True)
    note = (f"origin sent {served / src.stat().st_size:.2f} copies; {from_peers}/{total} chunks from other "
            f"peers; {dups} end-game duplicates; {busy} busy answers")
    return {"time": elapsed, "file": with_file, "note": note}


def run_shardcast(star: Star, src: Path, work: Path, n: int, *, relay: bool) -> dict[str, Any]:
    root = work / f"shardcast{'-relay' if relay else ''}-{n}"
    bench = [PY, str(BROADCAST)]
    origin = Child(_in(star.host_ns[0], [*bench, "--role", "sc-origin", "--src", str(src), "--dir",
                                         str(root / "origin"), "--host", star.ip(0)]))
    kids: list[Child] = []
    outs: list[Path] = []
    try:
        hello = origin.read_until({"ready"})
        servers = hello["url"]
        first = 1
        if relay:
            middle = Child(_in(star.host_ns[1], [*bench, "--role", "sc-middle", "--url", hello["url"],
                                                 "--dir", str(root / "peer1"), "--host", star.ip(1),
                                                 "--version-name", hello["version"]]))
            kids.append(middle)
            servers = f"{hello['url']},{middle.read_until({'ready'})['url']}"
            first = 2
        for k in range(first, n + 1):  # one by one: its client probes every server at construction
            c = Child(_in(star.host_ns[k], [*bench, "--role", "sc-client", "--url", servers, "--dir",
                                            str(root / f"peer{k}"), "--version-name", hello["version"]]))
            c.read_until({"ready"})
            kids.append(c)
            outs.append(root / f"peer{k}" / "out.bin")
        t0 = time.perf_counter()
        for c in kids:
            c.send("go")
        done = _wait_all(kids, {"done"})
        elapsed = time.perf_counter() - t0
        if not all(ev["ok"] for ev in done):
            raise RuntimeError(f"shardcast download failed: {done}")
    finally:
        for c in [*kids, origin]:
            c.close()
    _verify(src, outs)
    shutil.rmtree(root, ignore_errors=True)
    note = "peer 1 is the MiddleNode; clients use origin + relay" if relay else "all clients of the origin"
    return {"time": elapsed, "note": note}


def _peer_counts(text: str) -> list[int]:
    """``2,4,8`` -> [2, 4, 8]; [] when the text is not such a list."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return []
    return counts if all(1 <= c <= 16 for c in counts) else []


def main() -> None:
    ap = argparse.ArgumentParser(description="Broadcast over shaped links (see the module docstring).")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--peers", default="2,4,8", help="peer counts to run, comma-separated")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="every host's uplink and downlink")
    ap.add_argument("--chunk-mib", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    ap.add_argument("--trace", type=Path, default=None,
                    help="write intellect's chunk events and link samples to TRACE-<peers>.json")
    args = ap.parse_args()
    counts = _peer_counts(args.peers)
    if not counts:
        ap.exit(2, f"--peers {args.peers!r}: give peer counts from 1 to 16, comma-separated (e.g. 2,4,8)\n")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        ap.exit(2, f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS)}\n")
    if args.size_mib < 1 or args.rate_mbit <= 0:
        ap.exit(2, "--size-mib and --rate-mbit must be positive\n")
    if (why := netns_unavailable_reason()) is not None:
        ap.exit(2, f"this benchmark needs network namespaces: {why}\n")
    os.environ.setdefault("SHARDCAST_LOG_LEVEL", "WARNING")  # its children log every shard at INFO
    size = args.size_mib * MIB
    bound = size * 8 / (args.rate_mbit * 1e6)
    work = Path(tempfile.mkdtemp(prefix="intellect-links-"))
    src = work / "checkpoint.bin"
    _make_source(src, size)
    os.chmod(work, 0o755)
    print(f"broadcast over links: {args.size_mib} MiB, every host {args.rate_mbit:g} Mbit/s up and down "
          f"(tc tbf), peers {counts}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"bound size/rate = {bound:.2f} s", flush=True)
    rows: list[tuple[int, str, float, str]] = []
    try:
        with Star(hosts=max(counts) + 1, rate_mbit=args.rate_mbit, log_dir=work / "logs") as star:
            for n in counts:
                results: dict[str, float] = {}
                for system in systems:
                    if system == "intellect":
                        trace = args.trace.with_name(f"{args.trace.stem}-{n}{args.trace.suffix}") \
                            if args.trace else None
                        r = run_intellect(star, src, work, n, args.chunk_mib, args.rate_mbit, trace)
                        rows.append((n, "intellect", r["time"], r["note"]))
                        rows.append((n, "intellect+file", r["file"], ""))
                    else:
                        r = run_shardcast(star, src, work, n, relay=system == "shardcast-relay")
                        rows.append((n, system.replace("-", " "), r["time"], r["note"]))
                    results[system] = r["time"]
                    print(f"  {n} peers, {rows[-1 if system != 'intellect' else -2][1]}: {r['time']:.2f} s "
                          f"({r['time'] / bound:.2f}x bound) {r['note']}  [load {os.getloadavg()[0]:.1f}]",
                          flush=True)
                sc = [results[s] for s in ("shardcast", "shardcast-relay") if s in results]
                if "intellect" in results and sc:
                    print(f"  {n} peers: intellect is {min(sc) / results['intellect']:.2f}x faster than "
                          f"shardcast 0.3.2 (its faster layout)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'peers':>5}  {'transfer':<16}{'time-to-all s':>14}{'x bound':>9}  note")
    for n in counts:
        print(f"{n:>5}  {'bound':<16}{bound:>14.2f}{1.0:>9.2f}  "
              f"{args.size_mib} MiB / {args.rate_mbit:g} Mbit/s")
        for m, name, t, note in rows:
            if m == n:
                print(f"{n:>5}  {name:<16}{t:>14.2f}{t / bound:>9.2f}  {note}")
    print("\naims at 8 peers: intellect <= 1.3x bound, >= 5x faster than shardcast. "
          f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
