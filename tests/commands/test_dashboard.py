"""The dashboard renders StatusSnapshots to a fixed 80x24 console; without a TTY it prints plain lines."""

from __future__ import annotations

import dataclasses
import io
import threading

import pytest
from rich.console import Console

from intellect_node import dashboard
from intellect_node.node.status import StatusBoard, StatusSnapshot
from tests.support.operator_node import FakeClock, busy_board


def _console(width: int = 80, height: int = 24) -> Console:
    return Console(record=True, width=width, height=height, force_terminal=True, color_system="truecolor",
                   file=io.StringIO())


def _fits(console: Console, width: int, height: int) -> str:
    text = console.export_text()
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= height, f"{len(lines)} lines:\n{text}"
    assert max(len(line) for line in lines) <= width
    return text


def _trained_board() -> StatusBoard:
    clock = FakeClock()
    b = busy_board(clock)
    for i in range(100):
        clock.t += 1
        b.train_step(i + 2, reward_mean=0.1 + i / 200, pass_rate=min(1.0, 0.2 + i / 150))
    return b


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40)])
def test_node_view_fits_and_shows_every_section(width: int, height: int) -> None:
    s = _trained_board().snapshot()
    c = _console(width, height)
    c.print(dashboard.render_node(s, width=width, now=s.ts))
    text = _fits(c, width, height)
    for expected in ("worker", "demo-run", "12D3KooWExample", "public", "v3 (swarm v5)", "stale 2/2",
                     "policy-5/shard-0", "toploc_mismatch", "bootstrap peer down", "proofs ok", "50% of 2",
                     "step 101", "▁", "█"):
        assert expected in text, expected


def test_first_steps_trend_survives_a_long_run() -> None:
    """Past HISTORY_LEN steps (the demo makes more in three minutes) "first10" still means the run's first
    ten steps, not the oldest ten the history still holds."""
    from intellect_node.node.status import HISTORY_LEN

    clock = FakeClock()
    b = busy_board(clock)
    for i in range(HISTORY_LEN + 100):
        clock.t += 1
        b.train_step(i, reward_mean=0.0 if i < 10 else 1.0, pass_rate=0.0 if i < 10 else 1.0)
    s = b.snapshot()
    c = _console()
    c.print(dashboard.render_node(s, width=80, now=s.ts))
    text = _fits(c, 80, 24)
    first = s.training.first  # the board's own first steps, then ours at 0.0
    assert len(first) == 10 and s.training.history[0].step > first[-1].step
    expected = sum(p.reward_mean for p in first) / 10
    assert f"first10 {expected:.3f}" in text and expected < 0.5 and "last10  1.000" in text


def test_empty_snapshot_renders() -> None:
    c = _console()
    c.print(dashboard.render_node(StatusSnapshot()))
    text = _fits(c, 80, 24)
    assert "waiting for the first policy" in text and "no trainer steps yet" in text
    c = _console()
    c.print(dashboard.render_swarm([]))
    _fits(c, 80, 24)


def test_swarm_view_fits_with_four_nodes_and_merges_events() -> None:
    base = _trained_board().snapshot()
    snaps = [dataclasses.replace(base, role=role, identity=dataclasses.replace(base.identity,
                                                                               peer_id=f"12D3KooW{role}{i:04d}"))
             for i, role in enumerate(["trainer", "validator", "worker", "worker"])]
    c = _console()
    c.print(dashboard.render_swarm(snaps, width=80, now=base.ts))
    text = _fits(c, 80, 24)
    assert text.count("worker") >= 2 and "validator" in text and "4 nodes" in text
    assert "reward" in text and "toploc_mismatch" in text


def test_sparkline_scales_and_clips() -> None:
    assert dashboard.sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert dashboard.sparkline(list(range(100)), 10) == dashboard.sparkline(list(range(90, 100)), 10)
    assert dashboard.sparkline([0.5] * 3, 10) == "▄▄▄"
    assert dashboard.sparkline([], 10) == "" and dashboard.sparkline([1.0], 0) == ""


def test_plain_lines_without_a_tty() -> None:
    board = _trained_board()
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    assert not console.is_terminal
    stop = threading.Event()
    calls = {"n": 0}

    def source() -> list[StatusSnapshot]:
        calls["n"] += 1
        if calls["n"] == 2:
            board.verdict(False, 4, reason="stale_policy", detail="v1 < v3 - 2")
        if calls["n"] >= 3:
            stop.set()
        return [board.snapshot()]

    dashboard.run(source, stop, console=console, plain_interval_s=0.01)
    lines = out.getvalue().splitlines()
    assert any("peers=3" in line and "acc=16" in line and "step=101" in line for line in lines)
    assert sum("rejected stale_policy: v1 < v3 - 2" in line for line in lines) == 1  # printed once
    assert "\x1b[" not in out.getvalue()  # no escape codes in logs


def test_new_event_lines_only_reports_newer() -> None:
    clock = FakeClock()
    b = busy_board(clock)
    first = b.snapshot()
    assert len(dashboard.new_event_lines(None, first)) == 2
    assert dashboard.new_event_lines(first, first) == []
    clock.t += 1
    b.warn("clock skew 3 s against 12D3KooWPeer")
    assert dashboard.new_event_lines(first, b.snapshot()) == [
        "worker …xample warning: clock skew 3 s against 12D3KooWPeer"]


def _line_with(console: Console, needle: str) -> str:
    """The line holding ``needle``, with its ANSI styles (31 = red text, 41 = red background)."""
    return next(line for line in console.export_text(styles=True, clear=False).splitlines() if needle in line)


def test_degraded_node_is_red_with_its_reasons() -> None:
    clock = FakeClock()
    b = busy_board(clock)
    b.set_state("running")
    b.set_degraded("libp2p", "libp2p restarting: the libp2p thread ended: DecodeError: Error parsing message")
    s = b.snapshot()
    assert s.state == "degraded" and not s.healthy
    c = _console()
    c.print(dashboard.render_node(s, now=s.ts))
    assert "\x1b[1;31mDEGRADED" in _line_with(c, "DEGRADED") and ";41m" in _line_with(c, "degraded ·")
    text = _fits(c, 80, 24)
    assert "degraded" in text and "DEGRADED libp2p restarting: the libp2p thread ended" in text
    assert "worker …xample degraded (libp2p restarting" in dashboard.status_line(s, now=s.ts)
    b.set_degraded("libp2p", "")
    s = b.snapshot()
    assert s.state == "running" and s.healthy and "DEGRADED" not in dashboard.status_line(s, now=s.ts)


def test_stale_and_unreachable_nodes_never_look_healthy() -> None:
    clock = FakeClock()
    board = busy_board(clock)
    board.set_state("running")
    board.refreshed()
    fresh = board.snapshot()
    assert fresh.freshness(fresh.ts) == "" and fresh.healthy
    # the viewer holds an old snapshot: 12 s later it is stale, numbers dimmed, state red
    c = _console()
    c.print(dashboard.render_node(fresh, now=fresh.ts + 12))
    text = _fits(c, 80, 24)
    assert "STALE (12 s) the numbers below are old" in text and "running" not in text.splitlines()[0]
    # the node's own status loop stopped refreshing: stale even in a brand-new snapshot
    clock.t += 30
    s = board.snapshot()
    assert s.age_s == 30 and s.freshness(s.ts) == "stale (30 s)"
    assert "stale(30s)" in dashboard.status_line(s, now=s.ts)
    # a node that did not answer: a placeholder with no numbers
    gone = StatusSnapshot.unreachable(role="validator", peer_id="12D3KooWValidator0001",
                                      detail="no answer in 3 s", now=fresh.ts)
    c = _console()
    c.print(dashboard.render_swarm([fresh, gone], width=80, now=fresh.ts))
    text = _fits(c, 80, 24)
    assert "unreachable" in text and "UNREACHABLE no answer in 3 s" in text
    row = next(line for line in text.splitlines() if "…or0001" in line)
    assert row.split()[2:] == ["unreachable"] + ["-"] * 7
    assert dashboard.status_line(gone, now=fresh.ts).endswith("unreachable: no answer in 3 s")
