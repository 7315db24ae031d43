"""Benchmark: the polysemanticity smoke grid on a local swarm of 1 and of 2 workers, in the same run.

Runs ``intellect-node sweep polysemanticity --grid smoke`` three times on 127.0.0.1:

1. 1 worker, spot checks at the default 5% (with one worker they cannot be placed and are waived);
2. 2 workers, spot checks at 5%;
3. 2 workers, no spot checks (the baseline for the cost of checking).

It prints each sweep's own wall time (from the moment every worker was present to the last accepted
result; node start-up is excluded and printed apart), the speed-up of 2 workers over 1 beside the ideal
2x as a ratio, the cost of the spot checks as a ratio of run 2 to run 3 and in extra executions, and
the per-(n, m) table beside n^2/4m, and the workers' utilisation (training time over workers x
sweep time), which separates the swarm's overhead from the machine's speed. All three runs must agree
job for job (the runs are deterministic); the bench says so or fails. The plot lands in ``--out``
(default ``bench/out/sweep``).

    .venv/bin/python bench/sweep.py [--grid smoke] [--out bench/out/sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from intellect_node.research.sweep import table  # noqa: E402


def run(out: Path, grid: str, workers: int, fraction: float) -> dict[str, Any]:
    if out.exists():
        shutil.rmtree(out)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "intellect_node.cli", "sweep", "polysemanticity",
                           "--grid", grid, "--workers", str(workers), "--check-fraction", str(fraction),
                           "--out", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    total = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"sweep failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary["total_s"] = total
    summary["digests"] = {r["job_id"]: (r["polysemantic"], r["sign_hash"]) for r in rows}
    summary["job_s"] = sum(r["seconds"] for r in rows)
    # Busy time over every execution (checks, tiebreaks and expired duplicates included), from the journal.
    events = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()[1:]]
    summary["busy_s"] = sum(e["record"]["seconds"] for e in events if e["e"] == "result")
    summary["utilisation"] = summary["busy_s"] / (workers * summary["elapsed_s"])
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", default="smoke")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "sweep")
    args = ap.parse_args()
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at start")
    runs = {}
    for name, workers, fraction in (("1 worker, 5% checks", 1, 0.05), ("2 workers, 5% checks", 2, 0.05),
                                    ("2 workers, no checks", 2, 0.0)):
        s = runs[name] = run(args.out / name.split(",")[0].replace(" ", "") / f"checks{fraction}", args.grid,
                             workers, fraction)
        c = s["counts"]
        print(f"{name:24s} sweep {s['elapsed_s']:7.1f}s  (process total {s['total_s']:6.1f}s)  "
              f"executions {s['executions']:3d} for {c['jobs']} jobs, checks {c['checks']} "
              f"({c['waived']} waived), mean job {s['job_s'] / c['jobs']:.2f}s, "
              f"worker utilisation {s['utilisation']:.0%}")
    one, two, base = runs.values()
    speedup = one["elapsed_s"] / two["elapsed_s"]
    print(f"speed-up 2 workers vs 1: {speedup:.2f}x; ideal 2.00x; ratio to ideal {speedup / 2:.2f}")
    # Machine-independent view: the share of the sweep's wall time the workers spent training.
    print(f"worker utilisation (busy time / (workers x sweep time)): 1 worker {one['utilisation']:.0%}, "
          f"2 workers {two['utilisation']:.0%}; "
          f"per-job time 1 worker {one['busy_s'] / one['executions']:.2f}s, "
          f"2 workers {two['busy_s'] / two['executions']:.2f}s "
          f"(the same jobs: a ratio above 1 is CPU contention)")
    print(f"spot checks at 5%: sweep {two['elapsed_s']:.1f}s vs {base['elapsed_s']:.1f}s without; ratio "
          f"{two['elapsed_s'] / base['elapsed_s']:.2f}; "
          f"extra executions {two['executions'] - base['executions']} "
          f"({(two['executions'] - base['executions']) / base['executions']:.1%})")
    same = one["digests"] == two["digests"] == base["digests"]
    print(f"all three runs agree job for job: {'yes' if same else 'NO'}")
    print(table(two))
    print(f"plot: {args.out / '2workers' / 'checks0.05' / 'plot.png'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
