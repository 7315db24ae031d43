#!/usr/bin/env python
"""Soak benchmark: the demo swarm for a long time, watching every node process for slow leaks.

Runs the same swarm as ``intellect-node demo --headless`` (trainer, validator, two workers as real
``intellect-node join`` processes on 127.0.0.1, the demo's RL settings) for ``--duration`` seconds
(default 3600) and samples each node's resident memory, open file descriptors and threads every
``--interval`` seconds from ``/proc/<pid>`` (plus its CPU seconds), and the trainer's steps from its status
snapshot. It prints one line per sample and, at the end, a table over time and, per node and measure,
the mean of the last quarter of the samples against the first quarter (ratio) and the least-squares
slope per hour. A measure is called flat when the last quarter's mean is within 10 % (RSS), 8
descriptors (fds) or 4 threads of the first's; a leak shows as a ratio that keeps growing with the
duration. (Slopes of a short run are noise: RSS moves by tens of MiB as torch frees and reuses memory.)

The first quarter starts after ``--warmup`` seconds (default 60): imports, model loads and the first
policy fetches grow every process once, which is not a leak. Flat figures of a swarm that stopped
training would prove nothing, so the soak also reports the longest gap between trainer steps and fails
(exit code 1) when the last quarter brought no step ("stalled"). Samples go to ``--out`` (JSON) as they
are taken, so a run cut short still leaves its data. A node that dies ends the soak early (exit code 1);
a failed soak keeps the nodes' data dirs and logs and names them.

    .venv/bin/python bench/soak.py [--duration 3600] [--interval 10] [--out soak.json] [--dir DIR]
                                   [--set validator.peer_notices_per_min=600 ...]

``--set SECTION.FIELD=VALUE`` (repeatable, VALUE as JSON or a plain string) changes the run's config on
every node, on top of the demo's RL settings.

Linux only (``/proc``). The bench process itself does no torch work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MEASURES = ("rss_mb", "fds", "threads")
FLAT_RATIO = 1.10
"""Last-quarter mean over first-quarter mean above which RSS counts as growing."""
FLAT_THREADS = 4
"""Threads a node may add between quarters: asyncio's default executor starts its worker threads lazily
(up to min(32, cores + 4)), so a few appear late in a healthy node; a leak keeps adding them."""
FLAT_FDS = 8
"""Descriptors a node may legitimately add between quarters (a few more peers' connections, HTTP
keep-alive)."""
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_sample(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open fds, threads and CPU seconds of ``pid`` from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the command name (which may hold spaces) start after the last ')'.
            rest = f.read().rsplit(")", 1)[1].split()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, IndexError, ValueError):
        return None
    # rest[0] is field 3 (state): utime is field 14, stime 15, num_threads 20.
    return {"rss_mb": rss_pages * _PAGE / 2**20, "fds": float(fds), "threads": float(rest[17]),
            "cpu_s": (int(rest[11]) + int(rest[12])) / _TICK}


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 2:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 0.0 if den == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den * 3600.0


def summarize(samples: list[dict[str, Any]], warmup: float) -> dict[str, dict[str, dict[str, float | bool]]]:
    """Per node and measure: first/last-quarter means (after the warm-up), their ratio, slope, flat."""
    steady = [s for s in samples if s["t"] >= warmup] or samples
    q = max(1, len(steady) // 4)
    out: dict[str, dict[str, dict[str, float | bool]]] = {}
    for name in steady[0]["nodes"] if steady else []:
        out[name] = {}
        for m in MEASURES:
            pts = [(s["t"], s["nodes"][name][m]) for s in steady if name in s["nodes"]]
            if not pts:
                continue
            first = statistics.fmean(y for _, y in pts[:q])
            last = statistics.fmean(y for _, y in pts[-q:])
            ratio = last / first if first else 1.0
            flat = {"fds": last - first <= FLAT_FDS,
                    "threads": last - first <= FLAT_THREADS}.get(m, ratio <= FLAT_RATIO)
            out[name][m] = {"first_quarter": round(first, 2), "last_quarter": round(last, 2),
                            "ratio": round(ratio, 3),
                            "slope_per_h": round(slope_per_hour(*map(list, zip(*pts))), 2),
                            "flat": flat}
    return out


def table(samples: list[dict[str, Any]], rows: int = 12) -> str:
    """Evenly spaced samples: time, trainer steps, and rss/fds/threads of each node."""
    if not samples:
        return "(no samples)"
    names = list(samples[0]["nodes"])
    pick = sorted({round(i * (len(samples) - 1) / max(1, rows - 1)) for i in range(rows)})
    head = f"{'t (s)':>7} {'steps':>6} " + " ".join(f"{n + ' MiB/fd/thr':>24}" for n in names)
    lines = [head]
    for i in pick:
        s = samples[i]
        cells = []
        for n in names:
            v = s["nodes"].get(n)
            cells.append(f"{v['rss_mb']:.0f}/{v['fds']:.0f}/{v['threads']:.0f}" if v else "-")
        lines.append(f"{s['t']:>7.0f} {s['steps']:>6} " + " ".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of soak after the swarm is up")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the first quarter")
    ap.add_argument("--out", type=Path, default=Path("soak.json"), help="samples and summary (JSON)")
    ap.add_argument("--dir", type=Path, default=None, help="keep the nodes' data here (default: temporary)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="config for every node, over the demo's (repeatable)")
    args = ap.parse_args()
    if not Path("/proc/self/statm").exists():
        print("soak needs Linux /proc", file=sys.stderr)
        return 2

    from intellect_node.commands.demo import DEMO_RL, DemoSwarm, StepLog

    extra: dict[str, dict[str, Any]] = {"rl": dict(DEMO_RL)}
    for item in args.set:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot and section and name):
            ap.error(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        extra.setdefault(section, {})[name] = value
    root = args.dir or Path(tempfile.mkdtemp(prefix="intellect-soak-"))
    swarm = DemoSwarm(root, workers=args.workers, validators=1, run_id=f"soak-{os.urandom(3).hex()}",
                      model=None, extra_config=extra)
    steps = StepLog()
    samples: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"duration_s": args.duration, "interval_s": args.interval, "warmup_s": args.warmup,
                           "root": str(root), "config": extra, "samples": samples}
    reason = "duration reached"
    t_up = time.monotonic()
    try:
        swarm.start(progress=lambda m: print(m, file=sys.stderr))
        t0 = time.monotonic()
        doc["startup_s"] = round(t0 - t_up, 1)
        next_at = t0
        while True:
            now = time.monotonic()
            if now - t0 > args.duration:
                break
            dead = swarm.dead()
            if dead:
                reason = f"{dead[0].name} died"
                print(swarm._death_note(dead[0]), file=sys.stderr)
                break
            if now < next_at:
                time.sleep(min(next_at - now, 1.0))  # pacing the samples, not waiting for a state
                continue
            next_at += args.interval
            steps.update(swarm.snapshots())
            nodes = {}
            for node in swarm.nodes:
                got = proc_sample(node.proc.pid) if node.proc is not None else None
                if got is not None:
                    nodes[node.name] = {k: round(v, 2) for k, v in got.items()}
            sample = {"t": round(now - t0, 1), "steps": len(steps.steps), "nodes": nodes}
            samples.append(sample)
            print(f"t={sample['t']:>7.0f}s steps={sample['steps']:>5} " + "  ".join(
                f"{n}={v['rss_mb']:.0f}M/{v['fds']:.0f}fd/{v['threads']:.0f}t" for n, v in nodes.items()),
                flush=True)
            if len(samples) % 6 == 0:  # keep what was measured if the run is cut short
                args.out.write_text(json.dumps(doc) + "\n")
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        codes = swarm.stop()
    elapsed = samples[-1]["t"] if samples else 0.0
    tail = [x for x in samples if x["t"] >= elapsed * 0.75]
    stalled = bool(tail) and tail[-1]["steps"] == tail[0]["steps"] and len(samples) >= 4
    if stalled and reason == "duration reached":
        reason = f"training stalled at step {tail[-1]['steps']} (no step in the last quarter)"
    doc.update(stopped_because=reason, exit_codes=codes, seconds=elapsed, stalled=stalled,
               longest_step_gap_s=round(max((b["t"] - a["t"] for a, b in _step_pairs(samples)),
                                            default=0.0), 1),
               steps=len(steps.steps), steps_per_s=round(len(steps.steps) / elapsed, 4) if elapsed else 0.0,
               summary=summarize(samples, args.warmup))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(samples))
    print(f"\n{len(steps.steps)} trainer steps in {elapsed:.0f} s ({doc['steps_per_s']} steps/s); "
          f"start-up {doc.get('startup_s', '?')} s; stopped: {reason}; exit codes {codes}")
    print(f"{'node':<11} {'measure':<8} {'first q':>9} {'last q':>9} {'ratio':>6} {'slope/h':>9}  flat")
    for name, per in doc["summary"].items():
        for m, v in per.items():
            print(f"{name:<11} {m:<8} {v['first_quarter']:>9} {v['last_quarter']:>9} {v['ratio']:>6} "
                  f"{v['slope_per_h']:>9}  {'yes' if v['flat'] else 'NO'}")
    print(f"longest gap between trainer steps: {doc['longest_step_gap_s']} s")
    print(f"samples written to {args.out}")
    ok = reason == "duration reached" and all(c == 0 for c in codes.values())
    if args.dir is None and ok:
        shutil.rmtree(root, ignore_errors=True)
    elif not ok:
        print(f"SOAK FAILED ({reason}); node data and logs kept in {root}")
    return 0 if ok else 1


def _step_pairs(samples: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(sample with a new step, the next sample with a new step), and the last one to the end: the gaps
    between trainer steps as the samples saw them."""
    marks = [x for i, x in enumerate(samples) if i == 0 or x["steps"] > samples[i - 1]["steps"]]
    if samples:
        marks.append(samples[-1])
    return list(zip(marks, marks[1:]))


if __name__ == "__main__":
    sys.exit(main())
