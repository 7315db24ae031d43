"""``[rl] env = "reasoning_gym:<dataset>"``: procedural problems from the reasoning-gym package.

reasoning-gym generates item ``i`` of a dataset from ``Random(seed + i)`` and the dataset's settings, and
scores an answer with the dataset's own ``score_answer(answer, entry)``. So a problem needs no file: its
ID ``reasoning_gym:<dataset>@<hash>/<i>`` lets any node rebuild it, where the hash covers the dataset's
full settings (``seed`` and ``size`` included, defaults filled in), the installed reasoning-gym version,
the extraction settings and the system prompt. Nodes that differ in any of these do not share problem
IDs, and a validator refuses the others' rollouts as ``unknown_task``.

Datasets are vetted, not trusted: :data:`REFUSED` lists the ones that cannot give every node the same
problem or a meaningful reward, and those whose checker evaluates the answer as Python (``eval``,
sympy's ``parse_expr``): a scoring process bounds time and memory, not what code may do, so a checker
that runs a worker's text would hand every validator to that worker. Measured on reasoning-gym 0.1.25
(generating items in processes with different ``PYTHONHASHSEED``, scoring wrong answers and answers
that touch a file when evaluated; docs/environments.md). :data:`SCREENED` datasets keep their
``parse_expr`` checker behind a character screen. Nothing is downloaded: the
package's procedural generators and bundled data files are all it uses.

Scoring runs ``score_answer`` in a scoring process under the run's time limit
(:mod:`intellect_node.envs.sandbox`): several datasets parse answers with sympy, and one raises on a
non-numeric answer; either way a completion gets 0 with a reason, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Mapping

from intellect_node.envs.extract import Extraction
from intellect_node.envs.sandbox import run_checker
from intellect_node.envs.scoring import EnvSettings, Memo, Scorer
from intellect_node.envs.tasks import Problem, problem_index
from intellect_node.errors import ConfigError

PREFIX = "reasoning_gym:"

DEFAULT_EXTRACTION = Extraction(mode="answer_tags", think="strip")
"""reasoning-gym's convention: the final answer between ``<answer>`` tags, after any reasoning."""

DEFAULT_SYSTEM_PROMPT = (
    "Work through the problem step by step. Then write only the final answer, in the exact format the "
    "question asks for, between <answer> and </answer> tags.")
"""Used when ``rl.system_prompt`` is unset: the model must be told where the extracted answer goes."""

_HASH_SEED = ("its problems depend on PYTHONHASHSEED (set order), so nodes would build different problems "
              "under one ID")
_EVAL = ("its score_answer runs eval() on the model's answer: a worker's completion would run as Python "
         "on every validator and the trainer")
_PARSE_EXPR = ("its score_answer gives the model's answer to sympy's parse_expr, which evaluates Python: a "
               "worker's completion would run as code on every validator and the trainer")

REFUSED: dict[str, str] = {
    "composite": "it mixes other datasets by weight; configure one dataset per run",
    "game_of_life_halting": "its score_answer gives 1.0 to any non-empty answer",
    "isomorphic_strings": _HASH_SEED,
    "knight_swap": _HASH_SEED,
    "ransom_note": _HASH_SEED,
    "word_ladder": _HASH_SEED,
    "polynomial_multiplication": _HASH_SEED + "; and " + _PARSE_EXPR.removeprefix("its "),
    "binary_matrix": _EVAL,
    "n_queens": _EVAL,
    "spiral_matrix": _EVAL,
    "string_insertion": _EVAL,
    "simple_integration": _PARSE_EXPR,
    "intermediate_integration": _PARSE_EXPR,
}
"""Datasets this client will not run, and why."""

ARITHMETIC_ONLY = re.compile(r"[0-9+\-*/(). \t]*")
"""countdown and puzzle24 also give the answer to parse_expr, but their answers are arithmetic on
integers: an answer of only these characters has no names, strings or attribute access, so evaluating
it computes a number (or hits the time and memory limits) and nothing else. Any other answer is
scored as an empty one, which both datasets score as malformed (0.01), what they give an answer that
does not parse."""

SCREENED = {"countdown": ARITHMETIC_ONLY, "puzzle24": ARITHMETIC_ONLY}
"""Datasets whose answers must match a pattern before their checker sees them."""

CACHE_PROBLEMS = 4096
"""Problems kept built per task: a validator resolves a problem once per rollout (a group of 16 shares
one), and some generators take a second per item."""

_GEN_LOCK = threading.Lock()
"""reasoning-gym generators are not thread-safe (pool_matrix seeds numpy's global generator)."""


def _registry() -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS  # deferred: importing reasoning-gym takes ~2 s

    return dict(DATASETS)


def available() -> list[str]:
    """Dataset names this client runs."""
    return sorted(n for n in _registry() if n not in REFUSED)


def version() -> str:
    return metadata.version("reasoning_gym")


def _checked_args(dataset: str, config_cls: type, args: Mapping[str, object]) -> dict[str, object]:
    """``args`` checked against the dataset's config dataclass: known fields, the defaults' types."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for need in ("seed", "size"):
        if need not in fields:
            raise ConfigError(f"reasoning_gym:{dataset} has no {need!r} setting, so its problems cannot be "
                              "rebuilt by ID", field="rl.env")
    out = dict(args)
    out.setdefault("seed", 0)  # reasoning-gym would pick a random seed: every node must use the same
    for key, value in out.items():
        if key not in fields:
            raise ConfigError(f"rl.env_args.{key}: reasoning_gym:{dataset} has no such setting; it has "
                              f"{sorted(fields)}", field=f"rl.env_args.{key}")
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool) or key in ("seed", "size"):
            want: tuple[type, ...] = (bool,) if isinstance(default, bool) else (int,)
        elif isinstance(default, int):
            want = (int,)
        elif isinstance(default, float):
            want = (int, float)
        elif isinstance(default, str):
            want = (str,)
        else:
            continue  # tuples, lists, optional fields: the dataset's validate() judges them
        if not isinstance(value, want) or (bool not in want and isinstance(value, bool)):
            raise ConfigError(f"rl.env_args.{key} = {value!r}: reasoning_gym:{dataset} expects "
                              f"{' or '.join(t.__name__ for t in want)}", field=f"rl.env_args.{key}")
    return out


@dataclass(frozen=True)
class _Score:
    """``score_answer`` of one entry, run in a scoring process (picklable: the child rebuilds nothing
    but the dataset object, cached per settings)."""

    dataset: str
    config_json: str
    entry: dict[str, Any]
    timeout_s: float

    def __call__(self, answer: str) -> float:
        screen = SCREENED.get(self.dataset)
        if screen is not None and not screen.fullmatch(answer):
            answer = ""
        value = run_checker(__name__, "score_in_child", self.dataset, self.config_json, self.entry, answer,
                            timeout_s=self.timeout_s, warm=("reasoning_gym",))
        return float(value)


_CHILD_DATASETS: dict[tuple[str, str], Any] = {}


def score_in_child(dataset: str, config_json: str, entry: dict[str, Any], answer: str) -> float:
    """``score_answer(answer, entry)`` with the dataset built from its settings (runs in a scoring
    process; the dataset objects are cached there)."""
    key = (dataset, config_json)
    ds = _CHILD_DATASETS.get(key)
    if ds is None:
        from reasoning_gym import create_dataset

        ds = _CHILD_DATASETS[key] = create_dataset(dataset, **json.loads(config_json))
    return float(ds.score_answer(answer, entry))


class ReasoningGymTask:
    """One reasoning-gym dataset under fixed settings (implements the ``Task`` protocol)."""

    def __init__(self, dataset: str, args: Mapping[str, object] | None = None,
                 settings: EnvSettings | None = None) -> None:
        registry = _registry()
        if dataset in REFUSED:
            raise ConfigError(f"reasoning_gym:{dataset} is not supported: {REFUSED[dataset]}; pick "
                              f"another of {available()}", field="rl.env")
        if dataset not in registry:
            raise ConfigError(f"reasoning_gym has no dataset {dataset!r}; available: {available()}",
                              field="rl.env")
        _, config_cls = registry[dataset]
        kwargs = _checked_args(dataset, config_cls, dict(args or {}))
        try:
            from reasoning_gym import create_dataset

            self._ds = create_dataset(dataset, **kwargs)
        except (AssertionError, ValueError, TypeError) as exc:
            raise ConfigError(f"rl.env_args for reasoning_gym:{dataset}: {exc or type(exc).__name__}",
                              field="rl.env_args") from exc
        self.dataset = dataset
        self.config = dataclasses.asdict(self._ds.config)
        """Every setting of the dataset, defaults filled in: what the hash covers."""
        self.settings = settings or EnvSettings(extraction=DEFAULT_EXTRACTION, system=DEFAULT_SYSTEM_PROMPT)
        self._config_json = json.dumps(self.config, sort_keys=True, default=repr)
        digest = self.settings.digest(env="reasoning_gym", dataset=dataset, config=self._config_json,
                                      version=version())
        self.task_id = f"{PREFIX}{dataset}@{digest}"
        self._size = len(self._ds)
        self._cache: OrderedDict[int, Problem] = OrderedDict()
        self._lock = threading.Lock()
        self._memo = Memo()

    def __len__(self) -> int:
        return self._size

    def problem(self, index: int) -> Problem:
        if not 0 <= index < self._size:
            raise ConfigError(f"problem index {index} out of range 0..{self._size - 1}", field="index")
        with self._lock:
            hit = self._cache.get(index)
            if hit is not None:
                self._cache.move_to_end(index)
                return hit
        with _GEN_LOCK:
            entry = self._ds[index]
        answer = entry.get("answer")
        pid = f"{self.task_id}/{index}"
        check = _Score(self.dataset, self._config_json, entry, self.settings.timeout_s)
        p = Problem(task_id=self.task_id, problem_id=pid, prompt=str(entry["question"]),
                    answer="" if answer is None else str(answer), checker="reasoning_gym",
                    system=self.settings.system,
                    scorer=Scorer(self.settings.extraction, check, pid, self._memo))
        with self._lock:
            self._cache[index] = p
            while len(self._cache) > CACHE_PROBLEMS:
                self._cache.popitem(last=False)
        return p

    def get(self, problem_id: str) -> Problem:
        return self.problem(problem_index(self.task_id, problem_id))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problem(rng.randrange(self._size)) for _ in range(n)]


def parse_env(env: str) -> str:
    """The dataset name of ``reasoning_gym:<dataset>``; ConfigError naming rl.env otherwise."""
    if not env.startswith(PREFIX) or not env[len(PREFIX):]:
        raise ConfigError(f"rl.env {env!r}: expected reasoning_gym:<dataset>, e.g. reasoning_gym:chain_sum",
                          field="rl.env")
    return env[len(PREFIX):]
