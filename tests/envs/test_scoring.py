"""Scoring processes: the time limit holds on input that makes sympy run forever, from any thread; a
hostile completion costs a reward of 0 with a reason, never an exception or a hung caller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from intellect_node.envs.environment import build_task
from intellect_node.envs.sandbox import ScoringFailed, ScoringPool, default_pool
from intellect_node.envs.tasks import Judgement
from tests.support.wait import wait_for

PATHOLOGICAL = "$\\boxed{9^{9^{9^{9}}}}$"
"""math-verify parses it in a fraction of a second, then sympy's comparison runs for hours."""


def test_time_limit_holds_off_the_main_thread() -> None:
    """The roles score on worker threads, where math-verify's own signal-based timeout cannot work."""
    pool = ScoringPool(1)
    results: list[object] = []

    def score() -> None:
        try:
            pool.call("intellect_node.envs.mathcheck", "verify_in_child", PATHOLOGICAL, "5", timeout_s=1.0,
                      warm=("math_verify", "sympy"))
        except ScoringFailed as exc:
            results.append(exc.reason)

    t = threading.Thread(target=score)
    t.start()
    t.join(timeout=120)
    try:
        assert not t.is_alive(), "the scorer's time limit did not hold"
        assert results == ["timeout"] and pool.killed == 1
        # the pool starts a fresh process and keeps scoring
        assert pool.call("intellect_node.envs.mathcheck", "verify_in_child", "0.5", "1/2") == 1.0
        assert pool.started == 2
    finally:
        pool.close()


def test_pathological_completion_scores_0_with_a_reason(tmp_path: Path) -> None:
    f = tmp_path / "hard.jsonl"
    f.write_text(json.dumps({"prompt": "?", "answer": "5", "checker": "math"}) + "\n")
    task = build_task(tasks_file=str(f), reward_timeout_s=1.0)
    p = task.problem(0)
    before = default_pool().killed
    assert p.judge(PATHOLOGICAL) == Judgement(0.0, "timeout")
    # the same answer again is remembered: a batch repeating it pays the limit once
    assert p.judge(PATHOLOGICAL) == Judgement(0.0, "timeout")
    assert default_pool().killed == before + 1
    assert p.judge("5") == Judgement(1.0)


def test_a_checker_that_raises_leaves_its_process_in_service() -> None:
    pool = ScoringPool(1)
    try:
        with pytest.raises(ScoringFailed) as info:
            pool.call("intellect_node.envs.mathcheck", "verify_in_child", "5", "")
        assert info.value.reason == "checker_error" and "not parseable" in info.value.detail
        assert pool.call("intellect_node.envs.mathcheck", "verify_in_child", "5", "5") == 1.0
        assert (pool.started, pool.killed) == (1, 0)
        with pytest.raises(ValueError, match="only intellect_node.envs"):
            pool.call("os", "system", "true")
    finally:
        pool.close()


def test_threads_share_the_pool() -> None:
    pool = ScoringPool(2)
    out: dict[int, float] = {}

    def score(i: int) -> None:
        # sympy imported before the timed call (as the checkers do): on a loaded machine that import
        # alone can take longer than the time limit
        out[i] = pool.call("intellect_node.envs.mathcheck", "verify_in_child", str(i), str(i % 3),
                           warm=("math_verify", "sympy"))

    threads = [threading.Thread(target=score, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    pool.close()
    assert out == {i: 1.0 if i == i % 3 else 0.0 for i in range(8)}
    assert pool.started <= 2


def test_hostile_text_never_raises(tmp_path: Path) -> None:
    f = tmp_path / "half.jsonl"
    f.write_text(json.dumps({"prompt": "?", "answer": "1/2", "checker": "math"}) + "\n")
    p = build_task(tasks_file=str(f), reward_timeout_s=1.0).problem(0)
    reasons = {}
    for text in ["\x00\udcff", "{" * 5000, "$" * 10_000, "<answer>" * 3000, "9" * 5000, "x" * 40_000]:
        judged = p.judge(text)
        assert judged.reward == 0.0
        reasons[text[:3]] = judged.reason
    assert reasons["{{{"] == "timeout" and reasons["xxx"] == "too_long"


CHILD_OF_DOOMED_PARENT = """
import sys
from intellect_node.envs.environment import build_task
from intellect_node.envs.sandbox import ScoringPool, default_pool
pool = ScoringPool(1)
pool.call("intellect_node.envs.mathcheck", "verify_in_child", "1", "1", warm=("math_verify", "sympy"))
print(pool._idle[0].proc.pid, flush=True)
pool.call("intellect_node.envs.mathcheck", "verify_in_child", sys.argv[1], "5", timeout_s=600)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_scoring_process_ends_with_a_killed_parent() -> None:
    """A node killed with SIGKILL runs no clean-up; its scoring process, stuck in a checker, must not
    outlive it."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD_OF_DOOMED_PARENT, PATHOLOGICAL],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    wait_for(lambda: _gone(child), timeout=30, what="the orphaned scoring process to end")
