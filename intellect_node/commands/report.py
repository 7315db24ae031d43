"""``intellect-node run report``: what a run did, as one self-contained HTML file a person opens.

It reads the data dirs given (a trainer's, a worker's, a validator's; a folder holding several data dirs,
such as the demo's, stands for all of them) and draws:

1. training reward and pass rate per step (``trainer/metrics.jsonl``, one line per step attempt);
2. held-out results per policy version, where a data dir holds them (``<role>/held_out.jsonl``: lines
   with ``version``, ``pass_rate``, ``mean_reward``, ``n`` and optionally ``evaluator``);
3. the step diagnostics the metrics lines carry, whichever of them there are: loss, KL, clipped fraction,
   grad norm, learning rate, staleness and batch ages, the filter's dropped fraction, the trainer's idle
   fraction; the step's timings (``*_s``) in a figure of their own;
4. throughput: rollouts taken into steps per second over a window of steps, and the rollouts the trainer
   accepted, refused as stale and saw rejected, as they add up;
5. rejections by reason (the workers' ledgers: the validators' verdicts, and what the trainer's step
   records say it did with accepted batches) and the audit state (``auditor/verdicts.jsonl`` of auditing
   validators, the evidence of failed audits under ``audits/``).

Figures are matplotlib PNGs inlined as base64 (``--png-dir`` also writes them as files); the page loads
nothing from anywhere. A source that is missing or torn is left out with a line saying so, never an
error: a report of a run in progress is still a report.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import typer

from intellect_node.commands.common import BootstrapOption
from intellect_node.errors import ConfigError, IntellectNodeError

if TYPE_CHECKING:
    from matplotlib.figure import Figure as PlotFigure

    from intellect_node.protocol.feed import RunFeed

METRICS = Path("trainer") / "metrics.jsonl"
HELD_OUT = "held_out.jsonl"
AUDITOR_VERDICTS = Path("auditor") / "verdicts.jsonl"
THROUGHPUT_WINDOW = 10
"""Steps per throughput point: a rate over one step swings with each batch's arrival."""
NOT_DIAGNOSTICS = frozenset({"step", "version", "time", "seq", "samples", "groups", "groups_used", "accepted",
                             "rejected", "stale", "reward_mean", "pass_rate", "trained", "taken_t",
                             "trained_t"})
"""Numeric keys of a metrics line drawn elsewhere (or counters and times that are not a diagnostic)."""
PREFERRED = ("loss", "kl", "kl_mean", "clipped_frac", "grad_norm", "lr", "entropy", "staleness_mean",
             "staleness_max", "batch_age_mean", "filtered_fraction", "idle_fraction")
"""The diagnostics drawn first, in this order, where the lines have them; any other numeric key follows."""


@dataclass
class Figure:
    name: str
    title: str
    png: bytes


@dataclass
class RunData:
    """What the data dirs hold about the run (:func:`collect`)."""

    dirs: list[Path]
    steps: list[dict[str, Any]] = field(default_factory=list)
    held_out: list[dict[str, Any]] = field(default_factory=list)
    rejections: dict[str, int] = field(default_factory=dict)
    """Rollouts rejected by the validators, by reason (the workers' ledgers)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Accepted batches the trainer's step records took without training on them, by outcome."""
    submitted: int = 0
    accepted: int = 0
    audits: dict[str, int] = field(default_factory=dict)
    failed_audits: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Sources missing or left out, said on the page."""


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def node_dirs(given: list[Path]) -> list[Path]:
    """The data dirs among ``given``: each one that holds a node's files, else its subfolders that do
    (the demo's folder). ConfigError naming ``--data-dir`` for a folder that is neither."""
    out: list[Path] = []
    for d in given:
        d = d.expanduser()
        if not d.is_dir():
            raise ConfigError(f"--data-dir {d}: no such folder", field="data_dir")
        if _is_node_dir(d):
            out.append(d)
            continue
        subs = [s for s in sorted(d.iterdir()) if s.is_dir() and _is_node_dir(s)]
        if not subs:
            raise ConfigError(f"--data-dir {d} is not a node's data dir (no node.key, ledger.sqlite or "
                              "blobs/) and holds none", field="data_dir")
        out += subs
    return list(dict.fromkeys(out))


def _is_node_dir(d: Path) -> bool:
    # Not ``trainer/``: the demo's folder holds a data dir of that name.
    return any((d / n).exists() for n in ("node.key", "ledger.sqlite", "blobs"))


def collect(dirs: list[Path]) -> RunData:
    """Read every source of :class:`RunData` from the data dirs (module docstring)."""
    from intellect_node.config.ledger import LEDGER_FILE, Ledger
    from intellect_node.fsutil import read_jsonl

    data = RunData(dirs=dirs)
    for d in dirs:
        lines = [dict(m) for m in read_jsonl(d / METRICS)]
        if lines:
            if data.steps:
                data.notes.append(f"{d}: a second trainer's metrics, left out (one run per report)")
            else:
                data.steps = [m for m in lines if _number(m.get("step")) is not None]
        for f in sorted(d.glob(f"*/{HELD_OUT}")):
            data.held_out += [dict(m) for m in read_jsonl(f) if _number(m.get("version")) is not None]
        if (d / LEDGER_FILE).is_file():
            try:
                with Ledger(d / LEDGER_FILE, readonly=True) as ledger:
                    s = ledger.summary()
            except ConfigError as exc:
                data.notes.append(f"{d}: ledger left out ({exc})")
            else:
                data.submitted += s.rollouts_submitted
                data.accepted += s.rollouts_accepted
                for reason, n in s.rejection_reasons.items():
                    data.rejections[reason] = data.rejections.get(reason, 0) + n
                for outcome, n in s.batches_dropped.items():
                    data.dropped[outcome] = data.dropped.get(outcome, 0) + n
        for v in read_jsonl(d / AUDITOR_VERDICTS):
            outcome = str(v.get("outcome", "?"))
            data.audits[outcome] = data.audits.get(outcome, 0) + 1
        for f in sorted(d.glob("audits/*/evidence/*.json")):
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict):
                data.failed_audits.append(doc)
    data.held_out.sort(key=lambda m: float(m["version"]))
    if not data.steps:
        data.notes.append("no trainer metrics (trainer/metrics.jsonl) in the data dirs given: give the "
                          "trainer's data dir for the training curves")
    return data


def diagnostics(steps: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per diagnostic key, (step, value) of each line that has it: :data:`PREFERRED` first, then the
    other numeric keys (timings ``*_s`` included) by name. ``batch_ages`` becomes ``batch_age_mean``."""
    series: dict[str, list[tuple[float, float]]] = {}
    for m in steps:
        step = float(m["step"])
        ages = m.get("batch_ages")
        if isinstance(ages, list) and ages and all(_number(a) is not None for a in ages):
            series.setdefault("batch_age_mean", []).append((step, sum(ages) / len(ages)))
        for key, value in m.items():
            v = _number(value)
            if v is not None and key not in NOT_DIAGNOSTICS and not key.endswith("_t"):
                series.setdefault(key, []).append((step, v))
    order = [k for k in PREFERRED if k in series] + sorted(k for k in series if k not in PREFERRED)
    return {k: series[k] for k in order}


def throughput(steps: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(step, rollouts taken into steps per second over the last :data:`THROUGHPUT_WINDOW` steps)."""
    timed = [(float(m["step"]), float(m["time"]), float(m.get("samples") or 0)) for m in steps
             if _number(m.get("time")) is not None]
    out = []
    for i in range(1, len(timed)):
        j = max(0, i - THROUGHPUT_WINDOW)
        dt = timed[i][1] - timed[j][1]
        if dt > 0:
            out.append((timed[i][0], sum(s for _, _, s in timed[j + 1:i + 1]) / dt))
    return out


# ============================================================================================ figures

def _png(fig: PlotFigure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def figures(data: RunData) -> list[Figure]:
    """The report's plots (matplotlib, Agg), each as PNG bytes; a plot with nothing to draw is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[Figure] = []

    def done(fig: PlotFigure, name: str, title: str) -> None:
        fig.tight_layout()
        out.append(Figure(name, title, _png(fig)))
        plt.close(fig)

    steps = data.steps
    if steps:
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for key, label, style in (("reward_mean", "mean reward", "-"), ("pass_rate", "pass rate", "--")):
            pts = [(float(m["step"]), v) for m in steps if (v := _number(m.get(key))) is not None]
            if pts:
                line, = ax.plot(*zip(*pts), style, marker=".", alpha=0.45, label=label)
                if len(pts) > THROUGHPUT_WINDOW:  # a step's figure swings: its mean over a window too
                    ys = [v for _, v in pts]
                    windows = [ys[max(0, i - THROUGHPUT_WINDOW + 1):i + 1] for i in range(len(ys))]
                    ax.plot([x for x, _ in pts], [sum(w) / len(w) for w in windows], style,
                            color=line.get_color(), label=f"{label}, {THROUGHPUT_WINDOW}-step mean")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        ax.grid(alpha=0.3)
        done(fig, "training", "Training reward and pass rate (the steps' own rollouts)")
    if data.held_out:
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for key, label in (("pass_rate", "held-out pass rate"), ("mean_reward", "held-out mean reward")):
            pts = [(float(m["version"]), v) for m in data.held_out if (v := _number(m.get(key))) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xlabel("policy version")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        ax.grid(alpha=0.3)
        done(fig, "held_out", "Held-out evaluation per policy version")
    series = diagnostics(steps)
    for name, keys, title in (
            ("diagnostics", [k for k in series if not k.endswith("_s")], "Step diagnostics"),
            ("timings", [k for k in series if k.endswith("_s")], "Step timings (seconds)")):
        if not keys:
            continue
        cols = min(3, len(keys))
        rows = -(-len(keys) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            ax.plot(*zip(*series[key]), marker=".", markersize=3, linewidth=1)
            ax.set_title(key, fontsize=10)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        done(fig, name, title)
    rate = throughput(steps)
    counters = [(float(m["step"]), m) for m in steps if _number(m.get("accepted")) is not None]
    if rate or counters:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), squeeze=False)
        if rate:
            axes[0][0].plot(*zip(*rate), marker=".")
        axes[0][0].set_title(f"rollouts taken into steps per second ({THROUGHPUT_WINDOW}-step window)",
                             fontsize=10)
        axes[0][0].set_xlabel("step")
        for key in ("accepted", "stale", "rejected"):
            pts = [(s, v) for s, m in counters if (v := _number(m.get(key))) is not None]
            if pts:
                axes[0][1].plot(*zip(*pts), label=key)
        axes[0][1].set_title("rollouts heard by the trainer (cumulative)", fontsize=10)
        axes[0][1].set_xlabel("step")
        if counters:
            axes[0][1].legend()
        for ax in axes[0]:
            ax.grid(alpha=0.3)
        done(fig, "throughput", "Throughput")
    return out


# ============================================================================================== HTML

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f4f4f4}img{max-width:100%;border:1px solid #eee}.note{color:#875}"""


def _table(rows: Sequence[tuple[str, object]], head: tuple[str, str] | None = None) -> str:
    out = ["<table>"]
    if head:
        out.append(f"<tr><th>{html.escape(head[0])}</th><th>{html.escape(head[1])}</th></tr>")
    out += [f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows]
    return "".join(out) + "</table>"


def summary(data: RunData) -> list[tuple[str, object]]:
    """The report's first table: steps, versions, time span, rollouts, the last figures."""
    rows: list[tuple[str, object]] = [("data dirs", ", ".join(str(d) for d in data.dirs))]
    steps = data.steps
    if steps:
        trained = [m for m in steps if m.get("trained")]
        times = [t for m in steps if (t := _number(m.get("time"))) is not None]
        rows += [("steps", f"{len(trained)} trained of {len(steps)} attempted"),
                 ("policy version", steps[-1].get("version")),
                 ("rollouts trained on", int(sum(_number(m.get("samples")) or 0 for m in trained)))]
        if len(times) > 1:
            span = max(times) - min(times)
            rows += [("from", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(min(times)))),
                     ("duration", f"{span / 3600:.2f} h" if span >= 3600 else f"{span:.0f} s")]
        for key in ("reward_mean", "pass_rate"):
            vals = [v for m in trained if (v := _number(m.get(key))) is not None]
            if vals:
                tail = vals[-THROUGHPUT_WINDOW:]
                rows.append((f"{key} (last {len(tail)} steps)", f"{sum(tail) / len(tail):.3f}"))
    if data.held_out:
        last = data.held_out[-1]
        rows.append(("held-out (newest)", f"v{last['version']}: pass rate {last.get('pass_rate')}, "
                                          f"n {last.get('n')}, by {last.get('evaluator', '?')}"))
    if data.submitted:
        rows.append(("workers' rollouts", f"{data.submitted} submitted, {data.accepted} accepted"))
    return rows


def render(data: RunData, figs: list[Figure], title: str) -> str:
    """The HTML page (one file: figures inlined as base64 PNG)."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             _table(summary(data))]
    for fig in figs:
        src = base64.b64encode(fig.png).decode("ascii")
        parts.append(f"<h2 id='{fig.name}'>{html.escape(fig.title)}</h2>"
                     f"<img alt='{html.escape(fig.title)}' src='data:image/png;base64,{src}'>")
    if not data.held_out:
        parts.append("<h2>Held-out evaluation</h2><p>No held-out results in these data dirs.</p>")
    parts.append("<h2 id='rejections'>Rejections</h2>")
    if data.rejections:
        by_count = sorted(data.rejections.items(), key=lambda kv: -kv[1])
        parts.append(_table(by_count,
                            ("validators' reason", "rollouts")))
    else:
        parts.append("<p>No rejected rollouts in the workers' ledgers of these data dirs.</p>")
    if data.dropped:
        parts.append(_table(sorted(data.dropped.items()),
                            ("trainer took, did not train: outcome", "batches")))
    if data.steps:
        last = data.steps[-1]
        parts.append(_table([(k, last.get(k)) for k in ("accepted", "stale", "rejected") if k in last],
                            ("trainer's rollout counters", "rollouts")))
    parts.append("<h2 id='audits'>Audits</h2>")
    if data.audits:
        state = "failed" if data.audits.get("fail") else "passing" if data.audits.get("pass") else "unaudited"
        parts.append(f"<p>State: <b>{state}</b></p>"
                     + _table(sorted(data.audits.items()), ("auditor's outcome", "steps")))
    else:
        parts.append("<p>No auditor's verdicts in these data dirs (give an auditing validator's).</p>")
    for ev in data.failed_audits:
        parts.append(_table([(k, ev.get(k)) for k in ("seq", "version", "auditor", "reason") if k in ev],
                            ("failed audit", "")))
    if data.notes:
        notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in data.notes)
        parts.append(f"<h2>Left out</h2>{notes}")
    parts.append(f"<p class='note'>Written by intellect-node run report, "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.</p></body></html>")
    return "\n".join(parts) + "\n"


def add_feeds(data: RunData, feeds: list[RunFeed], trainer: str, notes: list[str]) -> RunData:
    """The signed feeds a run's nodes served (``protocol/feed.py``, ``--run``) into ``data``: the
    trainer's metrics lines when no data dir gave them, every validator's held-out results (one per
    version and evaluator: a data dir and a feed may hold the same)."""
    from intellect_node.protocol.feed import objects

    for f in feeds:
        if f.node == trainer and f.metrics and not data.steps:
            data.steps = [m for m in objects(f.metrics) if _number(m.get("step")) is not None]
        data.held_out += [m for m in objects(f.held_out) if _number(m.get("version")) is not None]
    seen: set[tuple[float, str]] = set()
    unique = []
    for m in data.held_out:
        key = (float(m["version"]), str(m.get("evaluator", "")))
        if key not in seen:
            seen.add(key)
            unique.append(m)
    data.held_out = sorted(unique, key=lambda m: float(m["version"]))
    if data.steps:  # the data dirs' note that they held no metrics, answered by the trainer's feed
        data.notes = [n for n in data.notes if not n.startswith("no trainer metrics")]
    data.notes += notes
    if not data.steps and not any(n.startswith("no trainer metrics") for n in data.notes):
        data.notes.append(f"no trainer metrics: the run's trainer {trainer} served none")
    return data


def write_report(dirs: list[Path], out: Path, *, png_dir: Optional[Path] = None,
                 title: str = "intellect-node run report",
                 swarm: tuple[list[RunFeed], str, list[str]] | None = None) -> tuple[RunData, list[Figure]]:
    """Collect, draw and write ``out`` (and the PNGs into ``png_dir``). ``swarm``: the feeds of a run's
    nodes, its trainer's peer ID and notes on what could not be had (``--run``)."""
    from intellect_node.fsutil import atomic_write_bytes, atomic_write_text

    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name such as report.html", field="out")
    data = collect(node_dirs(dirs)) if dirs else RunData(dirs=[])
    if swarm is not None:
        add_feeds(data, *swarm)
    figs = figures(data)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, render(data, figs, title))
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for fig in figs:
            atomic_write_bytes(png_dir / f"{fig.name}.png", fig.png)
    return data, figs


def _from_swarm(cid: str, bootstrap: list[str]) -> tuple[list[RunFeed], str, list[str], str]:
    """The feeds of run ``cid``'s trainer and validators, the trainer's peer ID, notes, the run's ID:
    through a short-lived swarm with a fresh key (as ``runs``). Exit 1 when the run cannot be had."""
    import asyncio
    import tempfile

    from intellect_node.commands.common import data_dir
    from intellect_node.commands.runs import _is_cid, _network_of
    from intellect_node.roles.runs import client_swarm, fetch_run, run_feeds

    if not _is_cid(cid):
        raise ConfigError(f"--run {cid[:80]!r} is not a CID (the run's manifest CID `run init` printed)",
                          field="--run")
    addrs, listen = _network_of(data_dir(None), bootstrap, None)

    async def fetch() -> tuple[list[RunFeed], str, list[str], str]:
        with tempfile.TemporaryDirectory(prefix="intellect-report-") as tmp:
            async with client_swarm(addrs, listen=listen, data_dir=Path(tmp)) as (swarm, blobs):
                manifest, _raw = await fetch_run(blobs, cid)
                feeds, notes = await run_feeds(swarm, manifest)
                shared = manifest.config_dict().get("run") or {}
                trainer = str(shared.get("trainer_peer_id") or manifest.organiser)
                return feeds, trainer, notes, manifest.run_id

    try:
        return asyncio.run(fetch())
    except ConfigError:
        raise
    except IntellectNodeError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc


def add_to(group: typer.Typer) -> None:
    """``report`` in the ``run`` group."""

    @group.command("report")
    def report(
        data_dirs: list[Path] = typer.Option([], "--data-dir", "-d",
                                             help="A node's data dir (the trainer's for the curves; "
                                                  "workers' and validators' add rejections and audits), "
                                                  "or a folder of them such as the demo's. Repeatable."),
        run: Optional[str] = typer.Option(None, "--run", help="A run's manifest CID: its trainer's metrics "
                                                              "and its validators' held-out results, "
                                                              "fetched from the swarm (each signed by its "
                                                              "node)."),
        bootstrap: list[str] = BootstrapOption,
        out: Path = typer.Option(..., "--out", help="The HTML file to write (one self-contained page)."),
        png_dir: Optional[Path] = typer.Option(None, "--png-dir", help="Also write each plot as a PNG here."),
        title: str = typer.Option("intellect-node run report", "--title", help="The page's title."),
    ) -> None:
        """Write one HTML page of what a run did: training reward and pass rate, held-out results, step
        diagnostics, throughput, rejections by reason, audit state. From data dirs (--data-dir), or from
        the swarm (--run CID, with --bootstrap or the remembered peers of the default data dir), or both."""
        if not data_dirs and run is None:
            raise ConfigError("nothing to report on: give --data-dir DIR (a node's data dir, or the demo's "
                              "folder) or --run CID (a run's manifest CID, read from the swarm)",
                              field="--data-dir")
        swarm = None
        if run is not None:
            swarm = _from_swarm(run, list(bootstrap))
            if title == "intellect-node run report":
                title = f"intellect-node run report: {swarm[3]}"
        data, figs = write_report(data_dirs, out, png_dir=png_dir, title=title,
                                  swarm=(swarm[0], swarm[1], swarm[2]) if swarm is not None else None)
        typer.echo(f"wrote {out} ({len(data.steps)} steps, {len(figs)} plots"
                   f"{', ' + str(len(data.held_out)) + ' held-out results' if data.held_out else ''})")
        for note in data.notes:
            typer.echo(f"note: {note}")
