"""Reward scoring: what running checkers in a scoring process (the time limit) costs per completion.

    .venv/bin/python bench/reward_scoring.py [--calls 300]

For reasoning_gym:chain_sum (a trivial string checker) it times the dataset's own ``score_answer`` called
in this process (the baseline, no time limit possible off the main thread) against ``Problem.reward``
(extraction + a round trip to the scoring process), each on distinct answers so the per-task memo never
hits; then the ``math`` checker through the same path. Prints milliseconds per call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intellect_node.envs.environment import build_task  # noqa: E402
from intellect_node.envs.sandbox import default_pool  # noqa: E402
from intellect_node.envs.tasks import Problem  # noqa: E402


def per_call_ms(fn: Callable[[int], object], n: int) -> float:
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    n = ap.parse_args().calls

    from reasoning_gym import create_dataset

    task = build_task(env="reasoning_gym:chain_sum", env_args={"seed": 0, "size": 1000})
    ds = create_dataset("chain_sum", seed=0, size=1000)
    entry, p = ds[0], task.problem(0)
    p.reward("<answer>warm</answer>")  # start the scoring process and import reasoning-gym there
    direct = per_call_ms(lambda i: ds.score_answer(str(i), entry), n)
    sandboxed = per_call_ms(lambda i: p.reward(f"<think>…</think><answer>{i}</answer>"), n)
    print(f"chain_sum score_answer in process: {direct:.3f} ms/call")
    print(f"chain_sum Problem.reward (scoring process, time limit): {sandboxed:.3f} ms/call "
          f"(+{sandboxed - direct:.3f} ms, {sandboxed / max(direct, 1e-9):.0f}x)")

    m = Problem("m", "m/0", "?", "\\frac{1}{2}", checker="math")
    m.reward("0.5")
    maths = per_call_ms(lambda i: m.reward(f"{i}/{2 * i + 1}"), max(n // 10, 10))
    print(f"math checker (math-verify, scoring process): {maths:.3f} ms/call "
          f"(round trip is {100 * (sandboxed - direct) / maths:.1f}% of it)")
    pool = default_pool()
    print(f"scoring processes started: {pool.started}, killed: {pool.killed}")


if __name__ == "__main__":
    main()
