"""The dashboard renders StatusSnapshots to a fixed 80x24 console; without a TTY it prints plain lines."""

from __future__ import annotations

import dataclasses
import io
import json
import threading

import pytest
from rich.console import Console

from intellect_node import dashboard
from intellect_node.config.status import StatusBoard, StatusSnapshot
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
    from intellect_node.config.status import HISTORY_LEN

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


def _not_learning_board() -> StatusBoard:
    """A trainer whose every reward is 0, with a few completions it re-scored (one with a terminal escape,
    as a hostile worker would send)."""
    from intellect_node.config.status import NO_SIGNAL_ATTEMPTS, Completion

    clock = FakeClock()
    b = busy_board(clock)
    for _ in range(NO_SIGNAL_ATTEMPTS):
        clock.t += 1
        b.train_attempt(groups=8, filtered=8, cause="all_zero",
                        hint="every reward 0: completions too short (rl.max_new_tokens 1, 100% reach it), "
                             "an answer format the model does not write (rl.answer_format answer_tags, no "
                             "answer in 8/8), or a task too hard for the model; see the recent completions")
    b.completions([Completion(ts=clock.t + i, problem_id=f"add3/{i}", prompt=f"What is {i} + 5?",
                              text=f"\x1b[2J{i + 5}" if i else "12 <answer>12</answer>",
                              answer="12" if i == 0 else None, expected=str(i + 5), reward=0.0,
                              reason="" if i == 0 else "no_answer")
                   for i in range(8)])
    return b


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40)])
def test_a_run_that_is_not_learning_says_so_with_its_completions(width: int, height: int) -> None:
    s = _not_learning_board().snapshot()
    c = _console(width, height)
    c.print(dashboard.render_node(s, width=width, height=height, now=s.ts))
    styled = c.export_text(styles=True, clear=False)
    assert "\x1b[1;37;41mNOT LEARNING" in _line_with(c, "NOT LEARNING")  # white on red
    text = _fits(c, width, height)
    lines = text.splitlines()
    # prominent: right under the identity line, before every panel
    assert lines[2].startswith("NOT LEARNING no learnable group in the last 3 step attempts: every reward 0")
    assert "completions too short (rl.max_new_tokens" in text and "recent completions" in text
    assert "0.00 no_answer want 12 '[2J12'" in text  # reward, why no answer, expected, the text's end
    assert height == 24 or "0.00 '12'      want 5  '12 <answer>12</answer>'" in text  # the answer found
    assert "'[2J" in text and "\x1b[2J" not in styled  # the peer's escape never reaches the terminal
    shown = sum(1 for line in lines if "want " in line)
    assert shown == (3 if height == 24 else 8)  # 24 rows: the completions take the events' place
    # the swarm view (the demo's) shows it too, with the trainer's completions
    snaps = [dataclasses.replace(s, role=role, identity=dataclasses.replace(s.identity, peer_id=f"12D3K{i}"))
             for i, role in enumerate(["trainer", "validator", "worker"])]
    c = _console(width, height)
    c.print(dashboard.render_swarm(snaps, width=width, height=height, now=s.ts))
    text = _fits(c, width, height)
    assert text.splitlines()[1].startswith("NOT LEARNING no learnable group")
    assert "recent completions" in text and "· trainer" in text and "want " in text
    assert "rejections and warnings" in text
    assert "NOT-LEARNING=3" in dashboard.status_line(s, now=s.ts)


def test_completions_and_no_warning_on_a_healthy_worker() -> None:
    from intellect_node.config.status import Completion

    clock = FakeClock()
    b = busy_board(clock)
    b.completions([Completion(ts=clock.t, problem_id="add3/1", prompt="What is 1 + 5?", text="6",
                              answer="6", expected="6", reward=1.0)])
    s = b.snapshot()
    c = _console()
    c.print(dashboard.render_node(s, now=s.ts))
    text = _fits(c, 80, 24)
    assert "NOT LEARNING" not in text and "1.00 '6'" in text and "← What is 1 + 5?" in text
    assert "toploc_mismatch" in text  # the events keep a share of the rows


def test_status_prints_the_not_learning_warning_and_the_attempts() -> None:
    from intellect_node.commands.status import summary

    s = _not_learning_board().snapshot()
    doc = {"peer_id": "12D3KooWExample", "health": {"state": "running", "reasons": []},
           "snapshot": json.loads(s.to_json())}
    lines = summary(doc).splitlines()
    assert lines[1].startswith("NOT LEARNING no learnable group in the last 3 step attempts: every reward 0")
    assert ("training    step 1 · 3 attempts, 3 with no learnable group (all_zero 3) · last filtered 100% "
            "of groups") in lines
    calm = json.loads(busy_board(FakeClock()).snapshot().to_json())
    healthy = summary({"health": {"state": "running"}, "snapshot": calm})
    assert "NOT LEARNING" not in healthy and "attempts" not in healthy


def test_the_training_panel_shows_the_last_step_sizes_and_a_too_large_step_warns() -> None:
    from intellect_node.config.status import StepDiagnostics

    clock = FakeClock()
    b = busy_board(clock)
    diag = StepDiagnostics(kl_sampler=0.12, clipped_frac=0.36, ratio_mean=1.1, ratio_max=3.5, grad_norm=0.4,
                           lr=5e-5, entropy=1.25, staleness_max=1)
    b.train_step(3, reward_mean=0.5, pass_rate=0.5, diagnostics=diag,
                 step_warning="the step is too large: KL to the sampler 0.120 nats/token; lower rl.lr")
    s = b.snapshot()
    c = _console(120, 40)
    c.print(dashboard.render_node(s, width=120, height=40, now=s.ts))
    text = _fits(c, 120, 40)
    assert "kl 0.12 clip 36% ratio≤3.50 gn 0.4 lr 5e-05 H 1.25 age≤1" in text
    assert "STEP TOO LARGE the step is too large: KL to the sampler 0.120" in text
    assert "STEP-TOO-LARGE" in dashboard.status_line(s, now=s.ts)


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40)])
def test_a_validator_shows_the_newest_held_out_evaluation(width: int, height: int) -> None:
    from intellect_node.config.status import HeldOut

    b = _trained_board()
    b.set_held_out(HeldOut(version=12, n=256, pass_rate=0.4375, mean_reward=0.5,
                           evaluator="12D3KooWEvalAbcdef", evaluators=2, confirmed=5, refused=1, at=1.0))
    s = b.snapshot()
    c = _console(width, height)
    c.print(dashboard.render_node(s, width=width, now=s.ts))
    text = _fits(c, width, height)
    assert "eval    v12 pass 0.44 …Abcdef ✓5 ✗1" in text, text
