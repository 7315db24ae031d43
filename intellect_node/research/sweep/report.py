"""A sweep's results: ``results.jsonl`` (one row per job), ``summary.json`` (aggregates) and ``plot.png``.

Polysemanticity configurations are summarised per (n, m) beside the paper's estimate n^2/(4m); the noise
variant per (noise, sigma) as mean fourth-norm curves. Only jobs whose result was accepted count.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from intellect_node.fsutil import atomic_write_text

if TYPE_CHECKING:
    from intellect_node.research.sweep.coordinator import Coordinator


def theory(n: int, m: int) -> float:
    """Expected polysemantic neurons, n^2 / (4m): collisions of n features on m neurons, of which the
    opposite-sign half survive the ReLU (the paper's estimate)."""
    return n * n / (4 * m)


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value)."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per (n, m): mean, std, seeds, counts, theory (poly); per (noise, sigma): fourth-norm curves (noise)."""
    done = [r for r in rows if r["status"] == "done"]
    poly: dict[tuple[int, int], list[dict[str, Any]]] = {}
    noise: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in done:
        if r["variant"] == "poly":
            poly.setdefault((r["n"], r["m"]), []).append(r)
        else:
            noise.setdefault((r["noise"], r["sigma"]), []).append(r)
    configs = []
    for (n, m), rs in sorted(poly.items()):
        rs.sort(key=lambda r: r["seed"])
        mean, std = _mean_std([r["polysemantic"] for r in rs])
        configs.append({"n": n, "m": m, "mean": mean, "std": std, "seeds": [r["seed"] for r in rs],
                        "counts": [r["polysemantic"] for r in rs], "theory": theory(n, m)})
    curves = []
    for (kind, sigma), rs in sorted(noise.items()):
        rs.sort(key=lambda r: r["seed"])
        steps = [s for s, _ in rs[0]["fourth_norm"]]
        per_step = list(zip(*[[v for _, v in r["fourth_norm"]] for r in rs]))
        finals = [r["fourth_norm"][-1][1] for r in rs]
        mean, std = _mean_std(finals)
        curves.append({"noise": kind, "sigma": sigma, "seeds": [r["seed"] for r in rs], "steps": steps,
                       "mean_curve": [sum(v) / len(v) for v in per_step],
                       "final_mean": mean, "final_std": std})
    return {"configs": configs, "noise_curves": curves,
            "jobs": len(rows), "done": len(done),
            "unresolved": [r["job_id"] for r in rows if r["status"] == "unresolved"],
            "open": [r["job_id"] for r in rows if r["status"] == "open"],
            "checks": {k: sum(1 for r in done if r.get("check") == k) for k in ("agreed", "waived")}}


def table(summary: dict[str, Any]) -> str:
    """The per-(n, m) table in Markdown (mean +/- std beside n^2/4m)."""
    lines = ["| n | m | seeds | polysemantic (mean ± std) | theory n²/4m |", "|---|---|---|---|---|"]
    for c in summary["configs"]:
        lines.append(f"| {c['n']} | {c['m']} | {len(c['seeds'])} | {c['mean']:.2f} ± {c['std']:.2f} | "
                     f"{c['theory']:.2f} |")
    for c in summary["noise_curves"]:
        lines.append(f"| noise {c['noise']} σ={c['sigma']} | | {len(c['seeds'])} | fourth norm "
                     f"{c['final_mean']:.3f} ± {c['final_std']:.3f} | |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """log-log counts vs m with the theory line (poly); fourth norm vs steps per configuration (noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_poly, has_noise = bool(summary["configs"]), bool(summary["noise_curves"])
    fig, axes = plt.subplots(1, has_poly + has_noise or 1, figsize=(6 * (has_poly + has_noise or 1), 4.5),
                             squeeze=False)
    ax_iter = iter(axes[0])
    if has_poly:
        ax = next(ax_iter)
        cs = summary["configs"]
        for n in sorted({c["n"] for c in cs}):
            sub = [c for c in cs if c["n"] == n]
            ms = [c["m"] for c in sub]
            for c in sub:  # every seed, slightly transparent; zero counts cannot go on a log axis
                pts = [x for x in c["counts"] if x > 0]
                ax.scatter([c["m"]] * len(pts), pts, s=10, alpha=0.3, color="tab:blue")
            pos = [c for c in sub if c["mean"] > 0]  # a log axis cannot show 0; the table does
            if pos:
                # Lower bars stop short of 0 for the same reason.
                lower = [min(c["std"], 0.9 * c["mean"]) for c in pos]
                ax.errorbar([c["m"] for c in pos], [c["mean"] for c in pos],
                            yerr=[lower, [c["std"] for c in pos]], fmt="o-", capsize=3, color="tab:blue",
                            label=f"measured mean ± std (n={n})")
            ax.plot(ms, [theory(n, m) for m in ms], "k--", label="theory n²/(4m)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("neurons m")
        ax.set_ylabel("polysemantic neurons")
        ax.set_title("Incidental polysemanticity")
        ax.legend()
    if has_noise:
        ax = next(ax_iter)
        for c in summary["noise_curves"]:
            style = {"bernoulli": "-", "gaussian": "--", "none": ":"}.get(c["noise"], "-")
            ax.plot(c["steps"], c["mean_curve"], style, label=f"{c['noise']} σ={c['sigma']}")
        ax.set_xlabel("step")
        ax.set_ylabel("mean over features of Σ_h W⁴")
        ax.set_title("Noise variant: fourth norm (mean over instances)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_outputs(out: Path, coord: Coordinator, *, meta: Mapping[str, object] | None = None
                  ) -> dict[str, Any]:
    """Write ``results.jsonl``, ``summary.json`` and ``plot.png`` into ``out``; return the summary."""
    return write_report(out, coord.rows(), dict(coord.banned), meta=meta)


def write_report(out: Path, rows: list[dict[str, Any]], banned: dict[str, str], *,
                 meta: Mapping[str, object] | None = None) -> dict[str, Any]:
    """:func:`write_outputs` from a snapshot of the rows (safe off the thread that owns the coordinator)."""
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    summary = summarize(rows)
    summary.update(meta or {})
    summary["banned"] = banned
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    plot(summary, out / "plot.png")
    return summary
