"""The terminal dashboard: renders :class:`~intellect_node.config.status.StatusSnapshot` values, nothing else.

Two views, both sized for an 80x24 terminal (and wider and taller ones: ``height`` gives the extra rows
to the completions and events):

- :func:`render_node`: one node in full (what ``intellect-node join`` shows);
- :func:`render_swarm`: several nodes, one line each, plus the training trend and recent events merged
  across them (what ``intellect-node demo`` shows).

Both show the run's audit state (``snapshot.audits``: the node view in its swarm panel, the swarm view
on its swarm line) and put a failed audit in red under their title, with the step, both hashes and
whether the node stopped following the trainer. Both put a run that is not learning
(``training.no_signal_warning``: every group's rewards equal, step after step) in red under their
title, and show the recent completions a node scored (its answer, the expected one, the reward) in a
panel of their own: the trainer's in the swarm view, which re-scores every worker's. On 24 rows the
warnings and the completions take the events panel's place.

Without a TTY (a pipe, a log file, systemd) :func:`run` prints a plain status line every
``plain_interval_s`` and one line per new rejection or warning instead of drawing.

The sparklines show the last values that fit the width, scaled between their own min and max (the
numbers beside them give the absolute values).

Status never lies: a ``degraded`` node is drawn in red with its reasons; a snapshot older than
``STALE_AFTER_S`` (or whose node's status loop stopped refreshing it) is marked ``stale`` and its numbers
dimmed; a node whose status could not be read (``StatusSnapshot.unreachable``) shows ``unreachable`` and
no numbers. See :func:`condition`.
"""

from __future__ import annotations

import datetime as _dt
import textwrap
import threading
import time
from typing import IO, Callable, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from intellect_node.config.status import Audits, Completion, Notice, Rejection, StatusSnapshot, Training

SPARK = "▁▂▃▄▅▆▇█"
ROLE_STYLE = {"trainer": "bold magenta", "validator": "bold cyan", "worker": "bold green"}
TREND_WINDOW = 10
"""Steps averaged for the trend's numbers (at most half the history, so the two means never overlap)."""
REACH_STYLE = {"public": "green", "relayed": "yellow", "private": "red", "unknown": "dim"}
NODE_FOOTER = "Ctrl-C stops the node"
SWARM_FOOTER = "Ctrl-C stops every node"
WARNING_LINES = 3
"""Lines the not-learning warning may take (its hint is cut past them)."""


# -- small formatting helpers ----------------------------------------------------------------------

def sparkline(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as block characters, scaled to their own range."""
    if width <= 0 or not values:
        return ""
    vals = list(values)[-width:]
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2 - 1] * len(vals)
    scale = (len(SPARK) - 1) / (hi - lo)
    return "".join(SPARK[int(round((v - lo) * scale))] for v in vals)


def short_peer(peer_id: str, n: int = 6) -> str:
    """``12D3KooW`` is common to every ed25519 peer ID; show the tail, which differs."""
    return f"…{peer_id[-n:]}" if len(peer_id) > n else (peer_id or "-")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # unreachable; keeps type checkers happy


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def clock(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else "--:--:--"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _bar(done: int, total: int, width: int) -> str:
    frac = min(1.0, done / total) if total > 0 else 0.0
    full = int(frac * width)
    return "█" * full + "░" * (width - full)


# -- shared pieces ---------------------------------------------------------------------------------

def _title(left: str, right: str, width: int, style: str = "bold white on blue") -> Text:
    pad = max(1, width - len(left) - len(right))
    return Text(left + " " * pad + right, style=style, overflow="crop", no_wrap=True)


def condition(s: StatusSnapshot, now: float) -> tuple[str, str, bool]:
    """``(label, style, trouble)`` for how a node is doing as seen at wall time ``now``: ``stale`` and
    ``unreachable`` override what the snapshot says, ``degraded`` is trouble too."""
    fresh = s.freshness(now)
    if fresh:
        return fresh, "bold red", True
    if s.state == "degraded":
        return "degraded", "bold red", True
    return s.state, ("green" if s.state == "running" else "yellow"), False


def _trouble_text(s: StatusSnapshot, now: float) -> Text:
    """One line saying what is wrong, for a node in trouble (see :func:`condition`)."""
    label, _style, _ = condition(s, now)
    t = Text(no_wrap=True, overflow="ellipsis")
    if label == "unreachable":
        t.append("UNREACHABLE ", style="bold red").append("; ".join(s.health.reasons) or "no status")
    elif label.startswith("stale"):
        t.append(f"STALE {label[5:].strip()} ", style="bold red").append("the numbers below are old",
                                                                        style="red")
    else:
        t.append("DEGRADED ", style="bold red").append("; ".join(s.health.reasons), style="red")
    return t


def _policy_text(s: StatusSnapshot) -> Text:
    p = s.policy
    if p.local < 0 and p.current < 0:
        return Text("waiting for the first policy", style="dim")
    style = "green" if p.staleness == 0 else ("yellow" if p.staleness <= max(1, s.run.async_level) else "red")
    t = Text(f"v{p.local} (swarm v{p.current})  ")
    t.append(f"stale {p.staleness}" + (f"/{s.run.async_level}" if s.run.async_level else ""), style=style)
    return t


def _trend(history_source: StatusSnapshot | None, width: int) -> RenderableType:
    """Reward and pass-rate sparklines from the snapshot that carries training history."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=7, no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    hist = history_source.training.history if history_source else ()
    if not hist:
        grid.add_row("reward", Text("no trainer steps yet", style="dim"), "")
        grid.add_row("pass", "", "")
    else:
        # Per-step values from small batches are noisy: the numbers are means over the last and the
        # first n steps, so the trend reads at a glance; the sparkline keeps the per-step detail. The
        # first steps come from ``first`` (kept from the start) once the history has moved past them.
        n = max(1, min(TREND_WINDOW, len(hist) // 2))
        training = history_source.training if history_source else None
        start = training.first if training and len(training.first) >= n else hist
        rewards = [p.reward_mean for p in hist]
        passes = [p.pass_rate for p in hist]
        spark_w = max(8, width - 7 - 28 - 6)
        grid.add_row("reward", Text(sparkline(rewards, spark_w), style="magenta"),
                     f"last{n} {_mean(rewards[-n:]):6.3f} · first{n} "
                     f"{_mean([p.reward_mean for p in start[:n]]):.3f}")
        grid.add_row("pass", Text(sparkline(passes, spark_w), style="green"),
                     f"last{n} {_mean(passes[-n:]):6.1%} · first{n} "
                     f"{_mean([p.pass_rate for p in start[:n]]):.1%}")
    step = history_source.training.step if history_source else -1
    d = history_source.training.diagnostics if history_source else None
    sizes = (f" · kl {d.kl_sampler:.3g} clip {d.clipped_frac:.0%} ratio≤{d.ratio_max:.2f} "
             f"gn {d.grad_norm:.3g} lr {d.lr:.2g} H {d.entropy:.2f} age≤{d.staleness_max}"
             ) if d is not None else ""
    return Panel(grid, title=f"training · step {step if step >= 0 else '-'}{sizes}", title_align="left",
                 box=box.ROUNDED, padding=(0, 1))


def _events(items: list[tuple[float, str, Text]], rows: int) -> RenderableType:
    """Newest-last list of (ts, who, text), clipped to ``rows`` lines."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(no_wrap=True, overflow="ellipsis")
    shown = sorted(items, key=lambda it: it[0])[-rows:]
    for ts, who, text in shown:
        grid.add_row(clock(ts), Text(who + " ", style="bold").append_text(text) if who else text)
    if not shown:
        grid.add_row("", Text("no rejections or warnings", style="dim"))
    for _ in range(rows - max(1, len(shown))):
        grid.add_row("", "")  # fixed height: the screen does not jump as events arrive
    return Panel(grid, title="recent rejections and warnings", title_align="left", box=box.ROUNDED,
                 padding=(0, 1))


def _learning_warning(t: Training) -> tuple[str, str]:
    """The training warning to show and its label: not learning first, else a step too large."""
    if t.no_signal_warning:
        return "NOT LEARNING", t.no_signal_warning
    return ("STEP TOO LARGE", t.step_warning) if t.step_warning else ("", "")


def _not_learning(warning: str, width: int, label: str = "NOT LEARNING") -> list[Text]:
    """The not-learning (or ``label``'s) warning, wrapped into at most :data:`WARNING_LINES` lines of
    ``width``."""
    if not warning:
        return []
    lines = textwrap.wrap(f"{label} {warning}", width=max(20, width - 1))
    if len(lines) > WARNING_LINES:
        lines = lines[:WARNING_LINES]
        lines[-1] = lines[-1][:max(0, width - 2)] + "…"
    out = []
    for i, line in enumerate(lines):
        t = Text(no_wrap=True, overflow="ellipsis")
        if i == 0:
            t.append(label, style="bold white on red").append(line[len(label):], style="bold red")
        else:
            t.append(line, style="bold red")
        out.append(t)
    return out


def audit_text(s: StatusSnapshot, *, short: bool = False) -> Text:
    """The run's audit state in a few words: a failure in red, steps that could not be audited in yellow
    (never shown as passed), no verdict at all as ``unaudited``; ``short``: without the age and detail."""
    a = s.audits
    age = s.audit_age_s
    ago = f" · last {duration(age)} ago" if age is not None and not short else ""
    if a.state == "failed":
        t = Text(f"FAILED step {a.first_failed.seq if a.first_failed else '?'}", style="bold red")
        t.append(" · refusing" if a.refusing else f" · {a.passed}/{a.audited} passed", style="red")
        return t
    if a.coverage == "low":
        t = Text(f"COVERAGE LOW {a.coverage_gap}/{a.checkpoint_every}", style="bold yellow")
        return t.append(" · refusing" if a.refusing else f" · {a.passed} passed", style="yellow")
    if a.state == "partial":
        return Text(f"{a.passed} passed, {a.unavailable} unavailable{ago}", style="yellow")
    if a.state == "passing":
        return Text(f"{a.passed} passed", style="green").append(ago, style="dim")
    return Text("unaudited" + (f" ({a.detail})" if a.detail and not short else ""), style="yellow")


def held_out_text(s: StatusSnapshot) -> Text:
    """The newest held-out evaluation a validator took (``snapshot.held_out``), in a few words: version,
    pass rate, evaluator, then the results confirmed (✓) and refused (✗, red) here."""
    h = s.held_out
    t = Text(f"v{h.version} pass {h.pass_rate:.2f} {short_peer(h.evaluator)}" if h.version >= 0
             else "none taken")
    t.append(f" ✓{h.confirmed}", style="dim")
    if h.refused:
        t.append(f" ✗{h.refused}", style="red")
    return t


def _audit_failed(a: Audits, width: int) -> list[Text]:
    """One red line for a failed audit (nothing otherwise): the step, the auditor, both hashes, and
    whether this node stopped following the trainer."""
    f = a.first_failed
    if a.state != "failed" or f is None:
        return []
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("AUDIT FAILED", style="bold white on red")
    t.append(f" step {f.seq} (v{f.version})", style="bold red")
    t.append(" · NOT FOLLOWING THE TRAINER" if a.refusing else " · still followed", style="bold red")
    t.append(f" · replay {short_peer(f.expected, 8)} ≠ published {short_peer(f.published, 8)} by "
             f"{short_peer(f.auditor)}", style="red")
    return [t]


def _completions(items: Sequence[Completion], rows: int, width: int, who: str = "") -> RenderableType:
    """The newest ``rows`` completions, newest last: reward, the answer found (or why none), the
    expected one, and the end of the completion, where answers are (the prompt after it if room)."""
    shown = list(items)[-rows:]
    found = [_clip(f"'{c.answer}'", 16) if c.answer is not None else _clip(c.reason or "no answer", 16)
             for c in shown]
    want = [_clip(f"want {c.expected}", 14) for c in shown]
    w_found, w_want = max(map(len, found), default=1), max(map(len, want), default=1)
    room = max(8, width - 2 - 4 - w_found - w_want - 3)  # the panel's padding, 3 gaps
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, width=4, justify="right")
    grid.add_column(no_wrap=True, width=w_found)
    grid.add_column(no_wrap=True, width=w_want)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    for c, f, wnt in zip(shown, found, want):
        body = Text(_clip(f"'{c.text}'", room, keep="tail"))
        if len(body) + 8 < room:
            body.append(f"  ← {c.prompt}", style="dim")
        style = "green" if c.reward >= 1.0 else ("yellow" if c.reward > 0 else "red")
        grid.add_row(Text(f"{c.reward:.2f}", style=style),
                     Text(f, style="bold" if c.answer is not None else "red"), Text(wnt, style="dim"), body)
    if not shown:
        grid.add_row("", Text("no completions scored yet", style="dim"), "", "")
    for _ in range(rows - max(1, len(shown))):
        grid.add_row("", "", "", "")  # fixed height, as the events
    title = "recent completions: reward, answer found, expected, text" + (f" · {who}" if who else "")
    return Panel(grid, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))


def _clip(text: str, n: int, *, keep: str = "head") -> str:
    """``text`` in at most ``n`` characters, "…" where cut: its start kept, or its end (a completion's
    answer is at its end)."""
    if len(text) <= n:
        return text
    return "…" + text[len(text) - n + 1:] if keep == "tail" else text[:n - 1] + "…"


def _bottom(events: list[tuple[float, str, Text]], completions: Sequence[Completion], rows: int,
            width: int, max_events: int, who: str = "") -> list[RenderableType]:
    """The completions and events panels in ``rows`` lines (their borders included): with completions,
    the events get about half the rows (none when only 5 are left), otherwise all of them."""
    if not completions:
        return [_events(events, max(1, min(max_events, rows - 2)))]
    inner = rows - 4
    if inner < 2:  # too short for both: the completions, since the warning says what is wrong
        return [_completions(completions, max(1, rows - 2), width, who)]
    n_events = min(max_events, max(1, inner // 2))
    n_comp = max(1, min(len(completions), inner - n_events))
    return [_completions(completions, n_comp, width, who), _events(events, n_events)]


def _rejection_text(r: Rejection) -> Text:
    t = Text("rejected ", style="red")
    t.append(r.reason, style="bold red")
    if r.detail:
        t.append(f" {r.detail}")
    if r.peer:
        t.append(f" by {short_peer(r.peer)}", style="dim")
    return t


def _notice_text(n: Notice) -> Text:
    return Text(n.message, style="yellow" if n.level == "WARNING" else "bold red")


def _node_events(s: StatusSnapshot, who: str = "") -> list[tuple[float, str, Text]]:
    return ([(r.ts, who, _rejection_text(r)) for r in s.rollouts.last_rejections]
            + [(n.ts, who, _notice_text(n)) for n in s.warnings])


# -- one node --------------------------------------------------------------------------------------

def _identity_text(s: StatusSnapshot) -> Text:
    """What an operator hands to others (the multiaddr, which holds the peer ID) and points Prometheus at.
    Folded, never cut: a multiaddr with a peer ID is wider than 80 columns, and a shortened one is useless
    to copy."""
    ident = Text(overflow="fold")
    if s.identity.share_addr:
        ident.append("share ", style="dim").append(s.identity.share_addr, style="bold")
    else:
        ident.append("peer ", style="dim").append(s.identity.peer_id or "-", style="bold")
    ident.append("  metrics ", style="dim").append(s.identity.metrics_url or "off")
    if s.run.model:
        ident.append("  model ", style="dim").append(f"{s.run.model} {s.run.dtype}")
    return ident


def render_node(s: StatusSnapshot, *, width: int = 80, height: int = 24,
                footer: str = NODE_FOOTER, now: float | None = None) -> RenderableType:
    """Everything about one node, in at most ``height`` (24 or more) lines at 80 columns; a node in trouble
    gets a red title and a line saying what is wrong in place of its identity line."""
    now = time.time() if now is None else now
    role = s.role or "node"
    label, _style, trouble = condition(s, now)
    title = _title(f" intellect-node · {role} · run {s.run.run_id or '-'}",
                   f"{label} · up {duration(s.uptime_s)} ", width,
                   style="bold white on red" if trouble else "bold white on blue")
    if trouble:
        ident = _trouble_text(s, now)
    else:
        ident = _identity_text(s)
    swarm = Table.grid(padding=(0, 1))
    swarm.add_column(style="dim", no_wrap=True, min_width=7)
    swarm.add_column(no_wrap=True, overflow="ellipsis")
    peers = Text(f"{s.peers.count}", style="bold")
    peers.append(f"  (trainer {len(s.peers.trainers)}, validators {len(s.peers.validators)})", style="dim")
    swarm.add_row("peers", peers)
    trainer = s.peers.trainers[0] if s.peers.trainers else s.run.trainer_peer_id
    swarm.add_row("trainer", short_peer(trainer, 12) + ("  (connected)" if s.peers.trainers else ""))
    reach = Text(s.reachability.status, style=REACH_STYLE.get(s.reachability.status, ""))
    swarm.add_row("reach", reach.append(
        f" {s.reachability.relay and 'via ' + short_peer(s.reachability.relay)}", style="dim"))
    swarm.add_row("policy", _policy_text(s))
    swarm.add_row("shards", f"{s.shards.completed} done, {human_bytes(s.shards.bytes_downloaded)}")
    for sh in s.shards.active[:1]:
        swarm.add_row("", Text(f"{_bar(sh.bytes_done, sh.bytes_total, 10)} {sh.name}", no_wrap=True,
                               overflow="ellipsis"))
    if not s.shards.active:
        swarm.add_row("", "")
    swarm.add_row("audits", audit_text(s))
    if s.held_out.at:  # a validator of a run with held-out evaluation, once a result was heard
        swarm.add_row("eval", held_out_text(s))

    work = Table.grid(padding=(0, 1))
    work.add_column(style="dim", no_wrap=True, min_width=9)
    work.add_column(no_wrap=True, overflow="ellipsis")
    r = s.rollouts
    work.add_row("generated", f"{r.generated:,}")
    work.add_row("submitted",
                 Text(f"{r.submitted:,}").append(f" in {r.batches_submitted} batches", style="dim"))
    work.add_row("accepted", Text(f"{r.accepted:,}", style="green"))
    work.add_row("rejected", Text(f"{r.rejected:,}", style="red" if r.rejected else ""))
    work.add_row("proofs ok", f"{pct(s.proofs.acceptance_rate)} of {s.proofs.checked}")
    work.add_row("tokens/s", f"{s.throughput.tokens_per_s:,.1f}")
    work.add_row("tokens", f"{s.throughput.tokens_total:,}")

    half = Table.grid(expand=True)
    half.add_column(ratio=1)
    half.add_column(ratio=1)
    half.add_row(Panel(swarm, title="swarm", title_align="left", box=box.ROUNDED, padding=(0, 1)),
                 Panel(work, title="work", title_align="left", box=box.ROUNDED, padding=(0, 1)))
    label, text = _learning_warning(s.training)
    warning = _audit_failed(s.audits, width) + _not_learning(text, width, label)
    rows = height - NODE_FIXED_ROWS - len(warning)
    return Group(title, ident, *warning, half, _trend(s, width - 4),
                 *_bottom(_node_events(s), s.training.completions, rows, width - 4, max_events=4),
                 Text(footer, style="dim", no_wrap=True))


NODE_FIXED_ROWS = 16
"""The node view's rows outside its warning and its bottom panels: title, identity, the swarm and work
panels (9), the trend (4), the footer."""


# -- many nodes ------------------------------------------------------------------------------------

def render_swarm(snaps: Sequence[StatusSnapshot], *, width: int = 80, height: int = 24,
                 title: str = "intellect-node demo", footer: str = SWARM_FOOTER,
                 max_events: int = 6, now: float | None = None) -> RenderableType:
    """One line per node, the trainer's trend, and the recent events of all nodes. A node in trouble
    shows its state in red, its numbers dimmed (stale) or left out (unreachable), and what is wrong
    among the events."""
    now = time.time() if now is None else now
    run_id = next((s.run.run_id for s in snaps if s.run.run_id), "-")
    started = min((s.started_at for s in snaps if s.started_at), default=0.0)
    now = max((s.ts for s in snaps), default=0.0)
    head = _title(f" {title} · run {run_id} · {len(snaps)} nodes", f"up {duration(max(0.0, now - started))} ",
                  width)

    # padding only on the right of each cell: ten columns must fit in 80 characters
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, expand=True)
    table.add_column("role", no_wrap=True)
    table.add_column("peer", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("peers", justify="right", no_wrap=True)
    table.add_column("policy", justify="right", no_wrap=True)
    table.add_column("gen", justify="right", no_wrap=True)
    table.add_column("acc", justify="right", no_wrap=True)
    table.add_column("rej", justify="right", no_wrap=True)
    table.add_column("tok/s", justify="right", no_wrap=True)
    table.add_column("proofs", justify="right", no_wrap=True)
    events: list[tuple[float, str, Text]] = []
    for s in snaps:
        who = f"{s.role or 'node'} {short_peer(s.identity.peer_id, 4)}"
        label, style, trouble = condition(s, now)
        role_cell = Text(s.role or "node", style=ROLE_STYLE.get(s.role, ""))
        state_cell = Text(label.split(" ")[0], style=style)
        if label == "unreachable":
            table.add_row(role_cell, short_peer(s.identity.peer_id, 6), state_cell, *(["-"] * 7))
            events.append((s.ts, who, _trouble_text(s, now)))
            continue
        stale = s.policy.staleness
        pol = Text(f"v{s.policy.local}" if s.policy.local >= 0 else "-")
        if stale:
            pol.append(f" -{stale}", style="yellow")
        table.add_row(role_cell, short_peer(s.identity.peer_id, 6), state_cell, str(s.peers.count), pol,
                      str(s.rollouts.generated), str(s.rollouts.accepted),
                      Text(str(s.rollouts.rejected), style="red" if s.rollouts.rejected else ""),
                      f"{s.throughput.tokens_per_s:.0f}",
                      pct(s.proofs.acceptance_rate) if s.proofs.checked else "",
                      style="dim" if label.startswith("stale") else None)
        events += _node_events(s, who)
        if trouble:
            events.append((max(now, s.ts), who, _trouble_text(s, now)))
    trainer = next((s for s in snaps if s.training.history), None) or next(
        (s for s in snaps if s.role == "trainer"), None)
    failed = next((s.audits for s in snaps if s.audits.state == "failed"), None)
    label, text = next((_learning_warning(s.training) for s in snaps if _learning_warning(s.training)[1]),
                       ("", ""))
    warning = (_audit_failed(failed, width) if failed is not None else []) + _not_learning(text, width, label)
    # The trainer's completions (it re-scores every worker's), else the workers' own, merged.
    scorer = next((s for s in snaps if s.training.completions and "trainer" in s.role.split(",")), None)
    if scorer is not None:
        completions, who = scorer.training.completions, "trainer"
    else:
        completions = tuple(sorted((c for s in snaps for c in s.training.completions), key=lambda c: c.ts))
        who = "workers" if completions else ""
    rows = height - SWARM_FIXED_ROWS - len(snaps) - len(warning)
    return Group(head, *warning, table, _swarm_line(snaps), _trend(trainer, width - 4),
                 *_bottom(events, completions, rows, width - 4, max_events, who),
                 Text(footer, style="dim", no_wrap=True))


SWARM_FIXED_ROWS = 9
"""The swarm view's rows besides one per node, its warning and its bottom panels: title, the table's
header and rule, the swarm line, the trend (4), the footer."""


def _swarm_line(snaps: Sequence[StatusSnapshot]) -> Text:
    """Totals over the nodes: work judged by validators, throughput, newest policy."""
    judges = [s for s in snaps if "validator" in s.role.split(",")]
    acc = sum(s.rollouts.accepted for s in judges)
    rej = sum(s.rollouts.rejected for s in judges)
    tok = sum(s.throughput.tokens_per_s for s in snaps)
    newest = max((s.policy.current for s in snaps), default=-1)
    t = Text(" swarm ", style="bold", no_wrap=True, overflow="ellipsis")
    t.append(f"v{newest} · " if newest >= 0 else "no policy · ")
    t.append(f"verdicts {acc} acc ")
    t.append(f"{rej} rej", style="red" if rej else "")
    t.append(f" ({pct(acc / (acc + rej)) if acc + rej else '-'}) · {tok:.0f} tok/s · audit ")
    # the node that has heard the most (a failed one first): every node of a run hears the same verdicts
    seen = max(snaps, key=lambda s: (s.audits.state == "failed", s.audits.audited), default=None)
    return t.append_text(audit_text(seen, short=True) if seen is not None else Text("-"))


# -- plain lines for logs --------------------------------------------------------------------------

def status_line(s: StatusSnapshot, now: float | None = None) -> str:
    """One log line per node: what an operator greps for (state first, with what is wrong)."""
    label, _style, trouble = condition(s, time.time() if now is None else now)
    if label == "unreachable":
        return (f"{s.role or 'node'} {short_peer(s.identity.peer_id)} unreachable: "
                + "; ".join(s.health.reasons))
    state = label.replace(" ", "")
    if trouble and s.health.reasons:
        state += f" ({'; '.join(s.health.reasons)})"
    parts = [f"{s.role or 'node'} {short_peer(s.identity.peer_id)} {state}", f"peers={s.peers.count}",
             f"reach={s.reachability.status}", f"policy={s.policy.local}/{s.policy.current}",
             f"gen={s.rollouts.generated}", f"acc={s.rollouts.accepted}", f"rej={s.rollouts.rejected}",
             f"tok/s={s.throughput.tokens_per_s:.1f}"]
    if s.proofs.checked:
        parts.append(f"proofs_ok={pct(s.proofs.acceptance_rate)}")
    if s.training.history:
        last = s.training.history[-1]
        parts.append(f"step={last.step} reward={last.reward_mean:.3f} pass={last.pass_rate:.2f}")
    if s.training.no_signal_warning:
        parts.append(f"NOT-LEARNING={s.training.no_signal_streak}")
    elif s.training.step_warning:
        parts.append("STEP-TOO-LARGE")
    a = s.audits
    parts.append(f"audit={a.state}:{a.passed}/{a.audited}" + (f":unavailable={a.unavailable}"
                                                             if a.unavailable else ""))
    if a.state == "failed" and a.first_failed is not None:
        parts.append(f"AUDIT-FAILED=step{a.first_failed.seq}" + (":REFUSING-TRAINER" if a.refusing else ""))
    elif a.coverage == "low":
        parts.append(f"AUDIT-COVERAGE-LOW=gap{a.coverage_gap}/{a.checkpoint_every}"
                     + (":REFUSING-TRAINER" if a.refusing else ""))
    return " ".join(parts)


def new_event_lines(prev: StatusSnapshot | None, s: StatusSnapshot) -> list[str]:
    """Rejections and warnings in ``s`` newer than anything in ``prev``."""
    since = 0.0
    if prev is not None:
        since = max([r.ts for r in prev.rollouts.last_rejections] + [n.ts for n in prev.warnings] + [0.0])
    who = f"{s.role or 'node'} {short_peer(s.identity.peer_id)}"
    lines = [(r.ts, f"{who} rejected {r.reason}" + (f": {r.detail}" if r.detail else "")
              + (f" (by {r.peer})" if r.peer else "")) for r in s.rollouts.last_rejections if r.ts > since]
    lines += [(n.ts, f"{who} {n.level.lower()}: {n.message}") for n in s.warnings if n.ts > since]
    return [line for _, line in sorted(lines)]


# -- the loop --------------------------------------------------------------------------------------

Source = Callable[[], Sequence[StatusSnapshot]]


def run(source: Source, stop: threading.Event, *, console: Console | None = None, swarm_view: bool = False,
        refresh_s: float = 0.5, plain_interval_s: float = 10.0, plain_stream: IO[str] | None = None,
        title: str = "intellect-node demo", footer: str | None = None) -> None:
    """Draw until ``stop`` is set: a full-screen live view on a terminal, plain lines otherwise.

    ``source()`` returns the current snapshots (one for a node, several for the demo); an exception from
    it is shown as a warning line and the loop carries on (a node may be restarting).
    """
    console = console or Console()
    if console.is_terminal:
        _run_live(source, stop, console, swarm_view, refresh_s, title, footer)
    else:
        _run_plain(source, stop, plain_stream or console.file, plain_interval_s)


def _view(snaps: Sequence[StatusSnapshot], swarm_view: bool, width: int, height: int, title: str,
          footer: str | None) -> RenderableType:
    height = max(24, height)  # smaller terminals crop the bottom, as before
    if swarm_view or len(snaps) != 1:
        return render_swarm(snaps, width=width, height=height, title=title, footer=footer or SWARM_FOOTER)
    return render_node(snaps[0], width=width, height=height, footer=footer or NODE_FOOTER)


def _run_live(source: Source, stop: threading.Event, console: Console, swarm_view: bool, refresh_s: float,
              title: str, footer: str | None) -> None:
    def frame() -> RenderableType:
        try:
            snaps = list(source())
        except Exception as exc:  # the view must survive a node that is (re)starting
            return Text(f"waiting for status: {exc}", style="yellow")
        if not snaps:
            return Text("waiting for the nodes to start…", style="dim")
        return _view(snaps, swarm_view, console.width, console.height, title, footer)

    with Live(frame(), console=console, screen=True, auto_refresh=False, transient=False) as live:
        while not stop.wait(refresh_s):
            live.update(frame(), refresh=True)


def _run_plain(source: Source, stop: threading.Event, out: IO[str], interval: float) -> None:
    prev: dict[str, StatusSnapshot] = {}
    next_line = 0.0
    while True:
        try:
            snaps = list(source())
        except Exception as exc:  # same as above: report and keep going
            snaps = []
            print(f"{clock(time.time())} status unavailable: {exc}", file=out, flush=True)
        due = time.monotonic() >= next_line
        for s in snaps:
            key = s.identity.peer_id or s.role
            for line in new_event_lines(prev.get(key), s):
                print(f"{clock(s.ts)} {line}", file=out, flush=True)
            if due:
                print(f"{clock(s.ts)} {status_line(s)}", file=out, flush=True)
            prev[key] = s
        if due:
            next_line = time.monotonic() + interval
        if stop.wait(min(1.0, interval)):
            return
