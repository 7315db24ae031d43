"""Held-out evaluation at a validator: its own results, and the re-check of other nodes'.

With ``run.eval_every`` = N on, the run's held-out problems (``envs/heldout.py``) are never trained on.
The validator wires an :class:`Evaluations` in and hands it every policy version it loads
(:meth:`Evaluations.policy_loaded`); what it does:

1. With ``validator.evaluate`` on, a version ``v`` with ``v % N == 0`` is evaluated: every held-out
   problem, one completion each under sampler keys fixed by ``run.eval_seed``
   (``inference.evaluate.held_out_keys``), generated in fixed chunks of ``EVAL_CHUNK`` problems
   (``inference.evaluate.chunk_rewards``) with the run's temperature and ``rl.max_new_tokens``. The
   signed :class:`~intellect_node.protocol.evals.EvalResult` is gossiped on the ``evals`` topic and
   appended to ``validator/held_out.jsonl`` (what ``run report`` plots).
2. Evaluation never starves verification: it runs in one thread of its own, at the lowest CPU priority
   the OS gives a thread (nice 19), one evaluation or re-check at a time; a version still waiting when a
   newer evaluable one is loaded is skipped (``skipped``), and at most :data:`CHECKS_KEPT` re-checks
   wait.
3. Every validator takes the results it hears (signature, figures and digest checked at the gossip
   validator; a repeat, or one sealed outside the window, ignored and blamed on no one). One that
   names another seed or problem count than the run's, a version off the schedule, or a policy hash
   other than the one this validator holds for the version, is refused: the reason is recorded against
   its evaluator. So is a second result of one evaluator for one version with other rewards.
4. With ``validator.eval_recheck_fraction`` > 0 and the version's policy held here (a result heard
   before the version is loaded waits for it, bounded), that share of the chunks is evaluated again
   and every reward compared: the same problems, keys, batch and engine give the same tokens on the
   same kind of CPU (measured across processes and torch thread counts, ``tests/inference/
   test_evaluate.py``); across machines whose float arithmetic differs a near-tie of two tokens'
   probabilities can flip one sample, which ``validator.eval_recheck_tolerance`` (the share of compared
   problems that may differ, 0 by default) allows for. A reward this node could not score (its checker
   timed out) is not compared. Agreement counts as ``confirmed``; more differences than the tolerance
   refuse the result, recorded against the evaluator with the first problem that differs. The chunks
   are drawn from a secret of this process and the result's digest: the same result is checked on the
   same chunks here, and the evaluator cannot know which.

A result of a version this node has not loaded yet waits for it (bounded: :data:`PARKED_VERSIONS`,
:data:`PARKED_PER_VERSION`) and is shown only once it is loaded, so a result for a version the trainer
never made cannot pass for the newest.

:meth:`Evaluations.status` is the ``held_out`` part of the validator's status; the newest result goes to
the node's status board (``snapshot.held_out``, ``/metrics``): of the newest version's results, this
node's own, else one of ``run.validator_peer_ids``', else the first heard, with the evaluator's peer ID
and the results confirmed and refused here. With ``eval_recheck_fraction`` at 0 a shown result of
another node is its word, checked only for consistency and its policy hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import secrets
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from intellect_node.config import NodeConfig
from intellect_node.config.status import HeldOut, StatusBoard
from intellect_node.envs.heldout import HeldOutPart
from intellect_node.envs.tasks import Judgement, Problem
from intellect_node.errors import MessageIgnored
from intellect_node.fsutil import append_jsonl
from intellect_node.inference.base import LoadedEngine, SamplingConfig
from intellect_node.inference.evaluate import EVAL_CHUNK, chunk_rewards, held_out_keys
from intellect_node.protocol import codec
from intellect_node.protocol.evals import EVAL_KIND, EvalResult, make_result, result_validator, seal_result
from intellect_node.protocol.freshness import SeenDigests
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.seams import RoleSwarm
from intellect_node.roles.common.seen import BoundedMap
from intellect_node.roles.common.tasks import held_out_task

log = logging.getLogger(__name__)

CHECKS_KEPT = 4
"""Re-checks waiting at most; a result heard when they are full is shown unchecked."""
PARKED_VERSIONS = 8
"""Versions whose results wait for their policy to be loaded here (a result can arrive first)."""
PARKED_PER_VERSION = 16
"""Results of one version waiting for its policy; more are dropped (counted ``unchecked``)."""
EVALUATORS_KEPT = 64
"""Results of one version kept for the status, from as many evaluators (the first heard)."""
VERSIONS_SHOWN = 16
"""Versions whose results and tallies are kept for the status."""
UNJUDGED = frozenset({"timeout", "checker_error", "budget"})
"""Judgement reasons of a reward this node did not score: not compared in a re-check."""
REFUSALS_KEPT = 16


def _lower_priority() -> None:
    """The evaluation thread's niceness to 19 (Linux threads have their own): verification first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # another OS, or a sandbox that refuses: one thread still
        pass


@dataclass
class Tally:
    """What was heard of one version: the results taken (not refused) by evaluator, and the re-checks."""

    results: dict[str, EvalResult] = field(default_factory=dict)
    confirmed: int = 0
    refused: int = 0


class Evaluations:
    """One validator's held-out evaluation (the module docstring). Built by the validator, which calls
    :meth:`start` once it can run jobs and :meth:`policy_loaded` for every version it loads."""

    # set in __init__
    run_id: str
    every: int
    evaluate: bool
    fraction: float
    tolerance: float
    validators: frozenset[str]

    def __init__(self, cfg: NodeConfig, swarm: RoleSwarm, board: StatusBoard, directory: Path,
                 held: Callable[[int], tuple[str, LoadedEngine] | None]) -> None:
        run = cfg.run
        self.run_id, self.every, self.seed = run.run_id, run.eval_every, run.eval_seed
        self.evaluate = cfg.validator.evaluate and run.eval_every > 0
        if cfg.validator.evaluate and not run.eval_every:
            # A node's own setting meets a run that holds nothing out (the run's settings come from its
            # manifest when joined by CID): said once, not an error, so one config joins either kind.
            log.warning("validator.evaluate is on but run %s holds no problem out of training "
                        "(run.eval_every is 0 in its settings): this validator does not evaluate", run.run_id)
        self.validators = frozenset(run.validator_peer_ids)
        self.fraction = cfg.validator.eval_recheck_fraction
        self.tolerance = cfg.validator.eval_recheck_tolerance
        self.part: HeldOutPart | None = held_out_task(cfg) if run.eval_every else None
        self.n = run.eval_problems
        self.keys = held_out_keys(run.eval_seed, self.n)
        self.sampling = SamplingConfig(temperature=cfg.rl.temperature, top_p=1.0,
                                       max_new_tokens=cfg.rl.max_new_tokens)
        self.swarm = swarm
        self.board = board
        self.file = directory / "held_out.jsonl"
        self._held = held
        self._topic = topic(self.run_id, EVAL_KIND)
        self._open = result_validator(self.run_id)
        self._closing = False
        self._problems: list[Problem] | None = None  # built in the evaluation thread when first needed
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="held-out", initializer=_lower_priority)
        self._wake = asyncio.Event()
        self._next: tuple[int, str, LoadedEngine] | None = None  # the newest version waiting
        self._checks: deque[tuple[EvalResult, str, LoadedEngine]] = deque()
        self._parked: BoundedMap[int, list[tuple[EvalResult, str]]] = BoundedMap(PARKED_VERSIONS)
        self._taken: BoundedMap[tuple[str, int], str] = BoundedMap(4096)  # (evaluator, v) -> digest
        self._seen = SeenDigests()
        self._secret = secrets.token_bytes(32)
        self._newest_loaded = -1
        self.tallies: BoundedMap[int, Tally] = BoundedMap(VERSIONS_SHOWN)
        self.refusals: deque[str] = deque(maxlen=REFUSALS_KEPT)
        self.counts = {"evaluated": 0, "skipped": 0, "heard": 0, "confirmed": 0, "refused": 0,
                       "unchecked": 0, "ignored": 0, "rechecked_problems": 0}

    def subscribe(self) -> None:
        self.swarm.subscribe(self._topic, self._validate, self._on_result)

    async def run(self) -> None:
        """The evaluation loop: the newest evaluable version first, then the re-checks, one at a time."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._next is not None or self._checks:
                if self._next is not None:
                    (version, policy, engine), self._next = self._next, None
                    await self._evaluate(version, policy, engine)
                else:
                    r, evaluator, engine = self._checks.popleft()
                    await self._recheck(r, evaluator, engine)

    def close(self) -> None:
        """After the loop was cancelled: a judgement under way stops at its next chunk."""
        self._closing = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- own evaluations -------------------------------------------------------------------------

    def policy_loaded(self, version: int, policy: str, engine: LoadedEngine) -> None:
        """``version`` (policy hash ``policy``) is loaded here: evaluate it when it is on the schedule,
        and check the results of it that arrived first."""
        self._newest_loaded = max(self._newest_loaded, version)
        if self.evaluate and self.every and version % self.every == 0:
            if self._next is not None and self._next[0] < version:
                self.counts["skipped"] += 1
                log.info("held-out evaluation of v%d skipped: v%d is here", self._next[0], version)
            if self._next is None or self._next[0] < version:
                self._next = (version, policy, engine)
                self._wake.set()
        parked = self._parked.pop(version) or []
        for r, evaluator in parked:
            self._keep(r, evaluator)
            self._against_policy(r, evaluator, policy, engine)
        if parked:
            self._show()

    def _chunks(self) -> int:
        return math.ceil(self.n / EVAL_CHUNK)

    def _judge(self, engine: LoadedEngine, chunks: list[int]) -> dict[int, Judgement]:
        """In the evaluation thread: the problems (built once), then the chunks' judgements."""
        if self._problems is None:
            assert self.part is not None
            self._problems = [self.part.problem(j) for j in range(self.n)]
        out: dict[int, Judgement] = {}
        for c in chunks:  # chunk by chunk: a node stopping waits for one chunk at most
            if self._closing:
                break
            out.update(chunk_rewards(engine, self._problems, self.keys, self.sampling, [c]))
        return out

    async def _in_thread(self, engine: LoadedEngine, chunks: list[int]) -> dict[int, Judgement]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._judge, engine, chunks)

    async def _evaluate(self, version: int, policy: str, engine: LoadedEngine) -> None:
        t0 = time.monotonic()
        judged = await self._in_thread(engine, list(range(self._chunks())))
        result = make_result(run_id=self.run_id, version=version, policy=policy, seed=self.seed,
                             rewards=[judged[i].reward for i in range(self.n)])
        raw = seal_result(self.swarm.key, result)
        self.counts["evaluated"] += 1
        self._taken.put((self.swarm.peer_id, version), result.outcomes)
        self._tally(version).results[self.swarm.peer_id] = result
        self._show()
        log.info("held-out v%d: pass rate %.3f, mean reward %.3f over %d problems (%.1f s)", version,
                 result.pass_rate, result.mean_reward, self.n, time.monotonic() - t0)
        line = {"version": version, "pass_rate": result.pass_rate, "mean_reward": result.mean_reward,
                "n": self.n, "evaluator": self.swarm.peer_id, "policy": policy, "outcomes": result.outcomes,
                "time": time.time()}
        await asyncio.to_thread(append_jsonl, self.file, line)
        await self.swarm.publish(self._topic, raw)

    # -- results heard ---------------------------------------------------------------------------

    def _validate(self, data: bytes, origin: str) -> tuple[EvalResult, str]:
        """The gossip validator (trio thread): a signed, consistent result of this run, from its signer,
        inside its window and not taken before (else ignored)."""
        try:
            r, signer = self._open(data, origin)
            self._seen.take(signer, codec.encode(r), what=f"eval result of v{r.version}")
        except MessageIgnored:
            self.counts["ignored"] += 1
            raise
        return r, signer

    def _on_result(self, msg: tuple[EvalResult, str], origin: str) -> None:
        self.take(*msg)

    def take(self, r: EvalResult, evaluator: str) -> None:
        """One result heard, already opened and checked (the gossip handler's work)."""
        self.counts["heard"] += 1
        why = self._off_run(r)
        if why:
            self._refuse(r, evaluator, why)
            return
        prior = self._taken.get((evaluator, r.version))
        if prior == r.outcomes:  # the evaluator's own repeat (a restart evaluating it again): no news
            self.counts["ignored"] += 1
            return
        if prior is not None:
            self._refuse(r, evaluator, f"a second result for v{r.version} with other rewards")
            return
        self._taken.put((evaluator, r.version), r.outcomes)
        held = self._held(r.version)
        if held is None and r.version > self._newest_loaded:
            # Its policy may still come: shown and checked once it is loaded here. Not shown before, so a
            # result for a version the trainer never made cannot pass for the newest.
            parked = self._parked.get(r.version) or []
            if len(parked) < PARKED_PER_VERSION:
                parked.append((r, evaluator))
                self._parked.put(r.version, parked)
            else:
                self.counts["unchecked"] += 1
            return
        self._keep(r, evaluator)
        if held is not None:
            self._against_policy(r, evaluator, *held)
        else:  # a version this node no longer holds (or never did): shown, not checked
            self.counts["unchecked"] += 1
        self._show()

    def _keep(self, r: EvalResult, evaluator: str) -> None:
        results = self._tally(r.version).results
        if len(results) < EVALUATORS_KEPT:
            results[evaluator] = r

    def _off_run(self, r: EvalResult) -> str:
        """Why ``r`` is not an evaluation of this run's schedule ("" when it is)."""
        if not self.every:
            return "this run holds no problem out of training (run.eval_every is 0 here)"
        if r.seed != self.seed or r.n != self.n:
            return f"seed {r.seed} and {r.n} problems; the run's are {self.seed} and {self.n}"
        if r.version % self.every:
            return f"v{r.version} is not evaluated in this run (every {self.every} versions)"
        return ""

    def _against_policy(self, r: EvalResult, evaluator: str, policy: str, engine: LoadedEngine) -> None:
        if r.policy != policy:
            self._refuse(r, evaluator, f"policy {r.policy} is not v{r.version}'s ({policy})")
        elif self.fraction <= 0:
            self.counts["unchecked"] += 1
        elif len(self._checks) >= CHECKS_KEPT:
            self.counts["unchecked"] += 1
            log.info("held-out result of v%d by %s not re-checked: %d re-checks waiting", r.version,
                     evaluator, len(self._checks))
        else:
            self._checks.append((r, evaluator, engine))
            self._wake.set()

    def sample(self, r: EvalResult) -> list[int]:
        """The chunks this node checks of ``r``: ``eval_recheck_fraction`` of them (at least one), drawn
        from this process's secret and the result's digest."""
        total = self._chunks()
        k = min(total, max(1, round(self.fraction * total)))
        rng = random.Random(hashlib.sha256(self._secret + r.outcomes.encode()).digest())
        return sorted(rng.sample(range(total), k))

    async def _recheck(self, r: EvalResult, evaluator: str, engine: LoadedEngine) -> None:
        judged = await self._in_thread(engine, self.sample(r))
        compared = [i for i in sorted(judged) if judged[i].reason not in UNJUDGED]
        self.counts["rechecked_problems"] += len(compared)
        differ = [i for i in compared if judged[i].reward != r.rewards[i]]
        if len(differ) > self.tolerance * len(compared):
            i = differ[0]
            self._refuse(r, evaluator, f"problem {i}: reward {r.rewards[i]!r}, {judged[i].reward!r} here "
                         f"({len(differ)} of {len(compared)} re-checked differ)")
            return
        self.counts["confirmed"] += 1
        self._tally(r.version).confirmed += 1
        self._show()

    def _refuse(self, r: EvalResult, evaluator: str, why: str) -> None:
        self.counts["refused"] += 1
        tally = self._tally(r.version)
        tally.refused += 1
        if tally.results.get(evaluator) is r:
            del tally.results[evaluator]
        reason = f"eval result v{r.version}: {why}"
        self.refusals.append(f"{evaluator}: {reason}")
        self.swarm.peerbook.record_rejection(evaluator, f"{self._topic}: {reason}")
        log.warning("held-out result of %s refused: %s", evaluator, reason)
        self._show()

    # -- what is shown ---------------------------------------------------------------------------

    def _tally(self, version: int) -> Tally:
        tally = self.tallies.get(version)
        if tally is None:
            tally = Tally()
            self.tallies.put(version, tally)
        return tally

    def newest(self) -> tuple[int, str, EvalResult, Tally] | None:
        """The newest version with a result taken: ``(version, evaluator, result, tally)``; of its results
        this node's own first, then one of the run's validators', then the first heard."""
        own = self.swarm.peer_id
        for version, tally in sorted(self.tallies.items(), key=lambda vt: vt[0], reverse=True):
            if tally.results:
                ranked = sorted(tally.results, key=lambda e: (e != own, e not in self.validators))
                return version, ranked[0], tally.results[ranked[0]], tally
        return None

    def _show(self) -> None:
        found = self.newest()
        confirmed, refused, now = self.counts["confirmed"], self.counts["refused"], time.time()
        if found is None:
            self.board.set_held_out(HeldOut(confirmed=confirmed, refused=refused, at=now))
            return
        version, evaluator, r, tally = found
        self.board.set_held_out(HeldOut(version=version, n=r.n, pass_rate=r.pass_rate,
                                        mean_reward=r.mean_reward, evaluator=evaluator, policy=r.policy,
                                        evaluators=len(tally.results), confirmed=confirmed, refused=refused,
                                        at=now))

    def status(self) -> dict[str, object]:
        found = self.newest()
        newest = None
        if found is not None:
            version, evaluator, r, tally = found
            newest = {"version": version, "n": r.n, "pass_rate": r.pass_rate, "mean_reward": r.mean_reward,
                      "evaluator": evaluator, "policy": r.policy, "evaluators": len(tally.results),
                      "confirmed": tally.confirmed, "refused": tally.refused}
        return {"on": self.evaluate, "every": self.every, "problems": self.n if self.every else 0,
                "recheck_fraction": self.fraction, "newest": newest, **self.counts,
                "waiting": self._next[0] if self._next is not None else None,
                "checks_waiting": len(self._checks),
                "parked": sum(len(p) for _, p in self._parked.items()),
                "refusals": list(self.refusals)}
