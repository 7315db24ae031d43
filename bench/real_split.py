"""The real-model benchmark's training and held-out problems, disjoint by operand pair.

The task is reasoning-gym ``basic_arithmetic`` at the size ``inference/run_settings.py`` picks for a small
model: ``Calculate a + b.`` with ``a`` and ``b`` in 0..10 (121 ordered pairs, 66 unordered). Drawing the
held-out problems with another generator seed gives the same 121 questions again, so the split is made on
the question itself:

1. The unordered pair ``{a, b}`` is *held out* when it is one of the :data:`HELD_OUT_PAIRS` pairs with the
   smallest ``blake2b(DOMAIN + "min+max")`` digest among the 66 (13 pairs, 24 of the 121 ordered ones,
   20%). Unordered, so ``3 + 5`` held out means ``5 + 3`` is never trained on either.
2. Training problems: items ``0..TRAIN_SIZE-1`` of the generator seeded 0 whose pair is not held out.
   The swarm gets them as an offline-filter file (``rl.solve_rates_file``: every one of their problem IDs
   with a placeholder rate inside ``rl.solve_rate_band`` [0, 1]), the node's one way to narrow a task to
   a list of problems; the reward is untouched (reasoning-gym's own ``score_answer`` on the whole text,
   partial credit). TRL's dataset is drawn from the same filtered task and scored by the same
   ``Problem.reward``.
3. Held-out problems: the first ``n`` items of the generator seeded :data:`HELD_OUT_SEED` whose pair is
   held out, scored by the same code.

No held-out question can appear in training: a pair is on one side of the rule or the other.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

DOMAIN = b"intellect/real-learning/held-out/1\0"
OPERANDS = range(0, 11)
"""reasoning-gym's 1-digit operands (``max_digits`` 1 draws 0..10)."""
HELD_OUT_PAIRS = 13
"""Unordered pairs held out: 13 of 66 (about 20% of the ordered pairs)."""
TRAIN_SEED, TRAIN_SIZE = 0, 5000
"""The training generator: seed 0, 5,000 items (4,000 or so after the split: enough for 60 minutes)."""
HELD_OUT_SEED = 1_000_000
QUESTION = re.compile(r"Calculate (\d+) \+ (\d+)\.")


def _digest(pair: tuple[int, int]) -> bytes:
    return hashlib.blake2b(DOMAIN + f"{pair[0]}+{pair[1]}".encode(), digest_size=16).digest()


@cache
def held_out_pairs() -> frozenset[tuple[int, int]]:
    """The held-out unordered pairs ``(min, max)`` (the module docstring's rule 1)."""
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS if a <= b]
    return frozenset(sorted(pairs, key=_digest)[:HELD_OUT_PAIRS])


def operands(prompt: str) -> tuple[int, int]:
    """``(a, b)`` of ``Calculate a + b.``; ValueError for any other question (another task size)."""
    m = QUESTION.fullmatch(prompt)
    if m is None or int(m[1]) not in OPERANDS or int(m[2]) not in OPERANDS:
        raise ValueError(f"{prompt!r} is not a sum of two operands in 0..10: the split covers that task only")
    return int(m[1]), int(m[2])


def is_held_out(prompt: str) -> bool:
    a, b = operands(prompt)
    return (min(a, b), max(a, b)) in held_out_pairs()


def _base(settings: dict[str, Any], seed: int, size: int) -> Any:
    from intellect_node.envs.environment import build_task

    return build_task(env=settings["env"], env_args=dict(settings["env_args"], seed=seed, size=size),
                      answer_format=settings["answer_format"], system_prompt=settings["system_prompt"])


def write_training_file(settings: dict[str, Any], path: Path) -> int:
    """The training problems as an offline-filter file at ``path`` (rule 2); how many there are."""
    base = _base(settings, TRAIN_SEED, TRAIN_SIZE)
    ids = [p.problem_id for p in (base.problem(i) for i in range(len(base))) if not is_held_out(p.prompt)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict.fromkeys(ids, 0.5), sort_keys=True))
    return len(ids)


def training_settings(settings: dict[str, Any], path: Path) -> dict[str, Any]:
    """``settings`` with the training task: its generator (rule 2) narrowed by the file at ``path``
    (:func:`write_training_file`)."""
    return {**settings, "env_args": {**settings["env_args"], "seed": TRAIN_SEED, "size": TRAIN_SIZE},
            "solve_rates_file": str(path), "solve_rate_band": [0.0, 1.0]}


def training_task(settings: dict[str, Any]) -> Any:
    """The training problems as the nodes build them: the task narrowed by the settings' offline-filter
    file."""
    from intellect_node.envs.filtering import filter_by_rates_file

    return filter_by_rates_file(_base(settings, TRAIN_SEED, TRAIN_SIZE), settings["solve_rates_file"],
                                tuple(settings["solve_rate_band"]))


def held_out_task(settings: dict[str, Any], n: int) -> Any:
    """The first ``n`` held-out problems (rule 3), as a task whose problem ``i`` is the ``i``-th."""
    from intellect_node.envs.filtering import FilteredTask

    base = _base(settings, HELD_OUT_SEED, 10 * n)
    kept = [p for p in (base.problem(i) for i in range(len(base))) if is_held_out(p.prompt)][:n]
    if len(kept) < n:
        raise ValueError(f"only {len(kept)} held-out problems among {len(base)} items; lower --eval-n")
    return FilteredTask(base, kept)


def describe() -> dict[str, Any]:
    """The rule for the output JSON."""
    pairs = sorted(held_out_pairs())
    ordered = sum(2 if a != b else 1 for a, b in pairs)
    return {"rule": f"the unordered operand pair {{a, b}} is held out when it is one of the {HELD_OUT_PAIRS} "
                    f"pairs (of {len(OPERANDS) * (len(OPERANDS) + 1) // 2}) with the smallest "
                    "blake2b(DOMAIN + 'min+max'); training: items of generator seed "
                    f"{TRAIN_SEED} (size {TRAIN_SIZE}) with a pair not held out; held out: items of seed "
                    f"{HELD_OUT_SEED} with a held-out pair (bench/real_split.py)",
            "domain": DOMAIN.decode().rstrip("\0"), "held_out_pairs": [list(p) for p in pairs],
            "held_out_ordered_fraction": ordered / len(OPERANDS) ** 2}
