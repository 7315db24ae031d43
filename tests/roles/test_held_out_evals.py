"""Held-out evaluation of a run by its validators (``roles/validator/evals.py``), in one process
(``intellect_node.testing.roles``): a trainer's publisher announces policy versions 0..4 of the embedded
model; a validator with ``validator.evaluate`` signs a result for every ``run.eval_every``-th version with
that version's policy hash; a second validator evaluates part of each result again and confirms it. A
forged result (figures that do not follow from its rewards, another policy's hash, rewards that are not
the policy's) is refused with its reason recorded against its signer; a repeat, or one sealed outside
the window, is ignored and blamed on no one."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from intellect_node.commands.status import held_out_line
from intellect_node.config import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.models.loader import load_model
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.evals import (
    EVAL_DOMAIN,
    EVAL_KIND,
    EvalResult,
    make_result,
    open_result,
    seal_result,
)
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.policy import POLICY_KIND
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.roles.common.services import blob_service
from intellect_node.roles.validator.role import Validator
from intellect_node.testing.roles import InProcessNode, in_process_swarm, key_of, run_config
from tests.support.wait import wait_until

torch.set_num_threads(1)
RUN = "evals"
EVERY, N = 2, 16
RL = dict(group_size=2, problems_per_batch=2, max_new_tokens=4)
EVALS = topic(RUN, EVAL_KIND)


def _config(**validator: Any) -> NodeConfig:
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("evaluator").peer_id,
                     key_of("checker").peer_id], rl=RL, run_id=RUN, eval_every=EVERY, eval_problems=N)
    return cfg.model_copy(update={"validator": cfg.validator.model_copy(update=validator)})


def _versions(n: int) -> list[PolicyWeights]:
    """``n`` policies of the embedded model, each a little away from the last."""
    state = {k: v.clone() for k, v in load_model(None).state.items()}
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        out.append(PolicyWeights.from_state_dict(state))
        state = {k: v + 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point()
                 else v for k, v in state.items()}
    return out


def _published(node: InProcessNode) -> list[EvalResult]:
    return [open_result(raw, run_id=RUN)[0] for t, raw in node.swarm.published if t == EVALS]


def _held_out(node: InProcessNode) -> dict[str, Any]:
    held: dict[str, Any] = node.status()["held_out"]
    return held


def test_a_validator_evaluates_every_nth_version_and_another_confirms_it(tmp_path: Path) -> None:
    versions = _versions(5)

    async def main() -> None:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", _config(), None)
            evaluator = await net.start("evaluator", _config(evaluate=True), Validator.for_runtime)
            checker = await net.start("checker", _config(eval_recheck_fraction=1.0), Validator.for_runtime)
            mallory = await net.start("mallory", _config(), None)
            pub = PolicyPublisher(tmp_path / "pub", blob_service(trainer), trainer.swarm.key, RUN)
            policy_topic = topic(RUN, POLICY_KIND)
            for v, weights in enumerate(versions):
                _, raw = await pub.publish(v, weights)
                await trainer.swarm.publish(policy_topic, raw)
                await wait_until(lambda: all(v in n.status()["versions_held"]
                                           for n in (evaluator, checker)), 60, what=f"v{v} held")
                if v % EVERY == 0:
                    await wait_until(lambda: _held_out(checker)["confirmed"] == v // EVERY + 1, 120,
                                     what=f"v{v}'s result confirmed by the checker")
            results = _published(evaluator)
            assert [(r.version, r.policy, r.n, r.seed) for r in results] == [
                (v, versions[v].content_hash, N, 20261129) for v in (0, 2, 4)]
            assert _published(checker) == []  # evaluation off there: it only checks
            newest = _held_out(checker)["newest"]
            assert newest["version"] == 4 and newest["evaluator"] == evaluator.peer_id
            assert newest["pass_rate"] == results[-1].pass_rate and newest["confirmed"] == 1
            snap = checker.board.snapshot().held_out
            assert (snap.version, snap.evaluator, snap.confirmed, snap.refused) == (4, evaluator.peer_id,
                                                                                    3, 0)
            assert evaluator.board.snapshot().held_out.evaluator == evaluator.peer_id
            shown: dict[str, Any] = checker.board.snapshot().to_dict()  # what intellect-node status shows
            (line,) = held_out_line(shown["held_out"])
            assert line.startswith(f"held-out    v4: pass rate {results[-1].pass_rate:.3f}") and \
                f"over {N} problems, by {evaluator.peer_id} · 3 confirmed, 0 refused here" in line, line
            lines = [json.loads(x) for x in (tmp_path / "evaluator" / "validator" / "held_out.jsonl")
                     .read_text().splitlines()]
            assert [(x["version"], x["pass_rate"], x["n"]) for x in lines] == [
                (r.version, r.pass_rate, N) for r in results]
            honest = results[-1]
            await _forgeries(checker, mallory, honest, versions)
            await _repeats(checker, evaluator)
            assert not net.failures(), net.failures()

    asyncio.run(main())


async def _forgeries(checker: InProcessNode, mallory: InProcessNode, honest: EvalResult,
                     versions: list[PolicyWeights]) -> None:
    """Mallory's results about v4 (held by the checker): each refused, the reason against mallory."""
    book = checker.swarm.peerbook
    now = int(time.time() * 1000)

    async def refused(raw: bytes, why: str) -> None:
        before = len(book.rejections)
        await mallory.swarm.publish(EVALS, raw)
        await wait_until(lambda: len(book.rejections) > before, 60, what=f"refused: {why}")
        peer, reason = book.rejections[-1]
        assert peer == mallory.peer_id and why in reason, reason

    # its pass rate raised, signed anyway: refused at the gossip validator
    inflated = msgspec.structs.replace(honest, pass_rate=1.0, time_ms=now)
    await refused(mallory.swarm.key.seal(EVAL_DOMAIN, inflated), "not its rewards'")
    # rewards that do not match the digest
    await refused(mallory.swarm.key.seal(EVAL_DOMAIN, msgspec.structs.replace(
        honest, rewards=[1.0] * N, time_ms=now)), "digest is not its rewards'")
    # another policy's hash for v4
    other = make_result(run_id=RUN, version=4, policy=versions[3].content_hash, seed=honest.seed,
                        rewards=honest.rewards)
    await refused(seal_result(mallory.swarm.key, other), f"is not v4's ({versions[4].content_hash})")
    # consistent figures over rewards the policy does not give: the re-check finds the first that differs
    checker_refused = _held_out(checker)["refused"]
    flipped = [1.0 - honest.rewards[0], *honest.rewards[1:]]
    lie = make_result(run_id=RUN, version=4, policy=versions[4].content_hash, seed=honest.seed,
                      rewards=flipped)
    # mallory's hash for v4 was taken before it was refused: another result of it for v4 is a second one
    # (the re-check of rewards that are not the policy's: the next test)
    await refused(seal_result(mallory.swarm.key, lie), "a second result for v4")
    assert _held_out(checker)["refused"] == checker_refused + 1
    # off the run's schedule and settings
    await refused(seal_result(mallory.swarm.key, msgspec.structs.replace(lie, version=3)), "not evaluated")
    await refused(seal_result(mallory.swarm.key, make_result(run_id=RUN, version=2, policy=cid_of(b"x"),
                                                             seed=1, rewards=flipped)), "the run's are")


async def _repeats(checker: InProcessNode, evaluator: InProcessNode) -> None:
    """The evaluator's result again (the same bytes), and one sealed 10 minutes ago: ignored, no one
    blamed."""
    book = checker.swarm.peerbook
    before, ignored = len(book.rejections), _held_out(checker)["ignored"]
    raw = next(raw for t, raw in evaluator.swarm.published if t == EVALS)
    await evaluator.swarm.publish(EVALS, raw)
    old = seal_result(evaluator.swarm.key, _published(evaluator)[0], now_ms=int(time.time() * 1000) - 600_000)
    await evaluator.swarm.publish(EVALS, old)
    await wait_until(lambda: _held_out(checker)["ignored"] == ignored + 2, 30, what="both ignored")
    assert len(book.rejections) == before


def test_a_result_whose_rewards_the_policy_does_not_give_is_refused_on_recheck(tmp_path: Path) -> None:
    versions = _versions(1)

    async def main() -> None:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", _config(), None)
            checker = await net.start("checker", _config(eval_recheck_fraction=0.5), Validator.for_runtime)
            mallory = await net.start("mallory", _config(), None)
            pub = PolicyPublisher(tmp_path / "pub", blob_service(trainer), trainer.swarm.key, RUN)
            # the result comes before the policy: it waits for it, then is checked
            rewards = [0.5] * N  # the exact checker gives 0 or 1: no completion earns these
            lie = make_result(run_id=RUN, version=0, policy=versions[0].content_hash, seed=20261129,
                              rewards=rewards)
            await mallory.swarm.publish(EVALS, seal_result(mallory.swarm.key, lie))
            await wait_until(lambda: _held_out(checker)["heard"] == 1, 30, what="the result heard")
            assert _held_out(checker)["newest"] is None and _held_out(checker)["parked"] == 1  # not shown yet
            _, raw = await pub.publish(0, versions[0])
            await trainer.swarm.publish(topic(RUN, POLICY_KIND), raw)
            await wait_until(lambda: _held_out(checker)["refused"] == 1, 120, what="the lie refused")
            why = checker.swarm.peerbook.last_rejection(mallory.peer_id) or ""
            assert "eval result v0: problem " in why and "here" in why, why
            held = _held_out(checker)
            assert held["newest"] is None and held["confirmed"] == 0 and held["rechecked_problems"] == N // 2
            snap = checker.board.snapshot().held_out
            assert (snap.version, snap.evaluator, snap.refused) == (-1, "", 1)  # nothing left to show
            assert held_out_line(snap.__dict__) == ["held-out    none taken · 0 confirmed, 1 refused here"]
            assert not net.failures(), net.failures()

    asyncio.run(main())



def test_a_version_still_waiting_when_a_newer_one_is_loaded_is_skipped(tmp_path: Path) -> None:
    """Evaluation never queues up behind itself: of v0, v2 and v4 loaded while the evaluation thread is
    busy, only v4 is evaluated; odd versions are not on the schedule."""
    from intellect_node.inference import make_engine
    from intellect_node.roles.validator.evals import Evaluations
    from intellect_node.testing.roles import FakeSwarm

    cfg = _config(evaluate=True)
    swarm = FakeSwarm(key_of("evaluator"))
    board = StatusBoard()
    engine = make_engine(load_model(None), "torch")
    evals = Evaluations(cfg, swarm, board, tmp_path, lambda v: None)
    for v in range(5):
        evals.policy_loaded(v, cid_of(f"v{v}".encode()), engine)

    async def main() -> None:
        loop = asyncio.create_task(evals.run())
        try:
            await wait_until(lambda: swarm.published, 60, what="one evaluation published")
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            evals.close()

    asyncio.run(main())
    assert [open_result(raw, run_id=RUN)[0].version for _, raw in swarm.published] == [4]
    assert evals.counts["skipped"] == 2 and evals.counts["evaluated"] == 1
    assert board.snapshot().held_out.version == 4


def test_the_recheck_tolerance_allows_that_share_of_rewards_to_differ(tmp_path: Path) -> None:
    """``validator.eval_recheck_tolerance`` 0.1 over 16 problems re-checked: one reward that differs
    (a flipped near-tie between unlike CPUs) is confirmed, two are refused."""
    from intellect_node.inference import make_engine
    from intellect_node.inference.evaluate import EVAL_CHUNK, chunk_rewards
    from intellect_node.roles.validator.evals import Evaluations
    from intellect_node.testing.roles import FakeSwarm

    cfg = _config(eval_recheck_fraction=1.0, eval_recheck_tolerance=0.1)
    weights = _versions(1)[0]
    engine = make_engine(load_model(None), "torch")
    swarm = FakeSwarm(key_of("checker"))
    evals = Evaluations(cfg, swarm, StatusBoard(), tmp_path, lambda v: (weights.content_hash, engine))
    evals.policy_loaded(0, weights.content_hash, engine)
    assert evals.part is not None
    problems = [evals.part.problem(j) for j in range(N)]
    honest = chunk_rewards(engine, problems, evals.keys, evals.sampling, list(range(N // EVAL_CHUNK)))
    rewards = [honest[i].reward for i in range(N)]

    def forged(flips: int) -> EvalResult:
        rs = [1.0 - r if i < flips else r for i, r in enumerate(rewards)]
        r = make_result(run_id=RUN, version=0, policy=weights.content_hash, seed=cfg.run.eval_seed,
                        rewards=rs)
        return msgspec.structs.replace(r, time_ms=int(time.time() * 1000))

    async def main() -> None:
        loop = asyncio.create_task(evals.run())
        try:
            evals.take(forged(1), key_of("one").peer_id)
            await wait_until(lambda: evals.counts["confirmed"] == 1, 60, what="one difference confirmed")
            evals.take(forged(2), key_of("two").peer_id)
            await wait_until(lambda: evals.counts["refused"] == 1, 60, what="two differences refused")
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            evals.close()

    asyncio.run(main())
    assert "(2 of 16 re-checked differ)" in (swarm.peerbook.last_rejection(key_of("two").peer_id) or "")
    assert swarm.peerbook.last_rejection(key_of("one").peer_id) is None
