"""Problems are assigned, not chosen by the worker.

Seeds fixed a problem's samples, not which problems a worker submitted: it could submit only problems
the policy finds easy, make a problem's group under each fresh version and keep the one it liked, or send
part of a batch. Now each worker's k-th batch at policy version v must hold exactly window k of its
assignment at v (``envs/assignment.py``), which every node recomputes; validators refuse anything else as
``not_assigned`` (held against the worker), the trainer checks again at admission, and both report each
worker's windows never submitted.

The rule itself is a pure function (tested here over every task source); the validator and the trainer
are driven alone with real records of the embedded model (``_roles_inproc``); the last test runs a
trainer, a validator and two cheating workers together on the in-process fakes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from intellect_node.envs.tasks import AdditionTask, embedded_task
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.models.loader import embedded_model_dir
from intellect_node.protocol.rl import BatchVerdict, RolloutNotice
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.protocol.signing import SigningKey
from tests.security._roles_inproc import GROUP, RUN, batch_bytes, config, record, trainer_role, validator_role
from tests.support.verdicts import gossiped

TRAINER, VALIDATOR, WORKER, OTHER = (SigningKey(bytes([i]) * 32) for i in range(41, 45))
PER_BATCH = 2
CID = checkpoint_cid(embedded_model_dir())


def _assignments(task: Any, *, per: int = PER_BATCH, async_level: int = 2, windows: int = 4) -> Any:
    from intellect_node.envs.assignment import Assignments

    return Assignments(task, RUN, problems_per_batch=per, async_level=async_level,
                       windows_per_version=windows)


def _window(version: int, k: int, worker: SigningKey = WORKER) -> list[str]:
    """``worker``'s window ``k`` at ``version`` as the validators of these tests' run compute it."""
    from intellect_node.roles.common.tasks import run_assignments

    cfg = config(TRAINER.peer_id, [VALIDATOR.peer_id], problems_per_batch=PER_BATCH)
    return [p.problem_id for p in run_assignments(cfg, embedded_task()).problems(worker.peer_id, version, k)]


# -- the rule ------------------------------------------------------------------------------------------


def _tasks_file(tmp: Path, n: int) -> str:
    path = tmp / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "checker": "integer"})
                            + "\n" for i in range(n)))
    return str(path)


def _sources(tmp: Path) -> dict[str, Any]:
    """The run's task from each source ``[rl]`` can name, built as every role builds it."""
    from intellect_node.envs.environment import build_task
    from intellect_node.envs.filtering import filter_by_rates_file, save_solve_rates

    sums = build_task(tasks_file=_tasks_file(tmp, 90))
    rates = tmp / "rates.json"
    save_solve_rates(rates, {f"add3/{i}": (i % 10) / 10 for i in range(0, 2000, 7)})
    gym = build_task(env="reasoning_gym:basic_arithmetic", env_args={"seed": 1, "size": 500})
    return {"add3": build_task(task="add3"), "jsonl": sums, "reasoning_gym": gym,
            "filtered": filter_by_rates_file(embedded_task(), rates, (0.2, 0.8))}


def test_every_task_source_assigns_windows_every_node_recomputes(tmp_path: Path) -> None:
    for name, task in _sources(tmp_path).items():
        mine, theirs = _assignments(task), _assignments(task)  # the worker's and a validator's
        fresh: list[str] = []
        for v in range(3):  # async_level + 1 consecutive versions: fresh at once
            for k in range(4):
                ids = [p.problem_id for p in mine.problems(WORKER.peer_id, v, k)]
                assert len(set(ids)) == PER_BATCH, (name, ids)
                assert ids == [p.problem_id for p in theirs.problems(WORKER.peer_id, v, k)]
                batch = [pid for pid in ids for _ in range(GROUP)]
                assert theirs.check(WORKER.peer_id, v, batch, GROUP) == k, name
                assert [p.problem_id for p in theirs.problems(OTHER.peer_id, v, k)] != ids, name  # its own
                fresh += ids
        # a problem is assigned to a worker at most once among the versions fresh at the same time
        assert len(fresh) == len(set(fresh)), name


def test_the_permutation_is_a_bijection_with_its_inverse() -> None:
    from intellect_node.envs.assignment import Permutation

    for size in (1, 2, 3, 5, 64, 65, 1000):
        perm = Permutation(b"key", size)
        image = [perm(x) for x in range(size)]
        assert sorted(image) == list(range(size))
        assert [perm.inverse(y) for y in image] == list(range(size))
    assert [Permutation(b"a", 1000)(x) for x in range(8)] != [Permutation(b"b", 1000)(x) for x in range(8)]


def test_every_window_of_its_region_is_a_versions_and_a_worker_goes_through_its_whole_order() -> None:
    """A trainer without signal does not move on: a version must have windows for as long as its region
    lasts (a fixed few stalled such a run for good). Rounds still move on by ``windows_per_version``."""
    a = _assignments(embedded_task(), windows=4)
    assert a.layout.windows == a.layout.slots and a.layout.stride == 4
    last = a.layout.windows - 1  # the region's last window is still the version's
    batch = [p.problem_id for p in a.problems(WORKER.peer_id, 0, last) for _ in range(GROUP)]
    assert a.check(WORKER.peer_id, 0, batch, GROUP) == last
    # A whole region walked, on a task of the same kind cut the same way (10^4 problems in place of 10^6).
    small = _assignments(AdditionTask(2), windows=4)
    assert small.layout.windows == small.layout.slots and small.layout.regions == 3
    seen: set[str] = set()
    for k in range(small.layout.windows):
        batch = [p.problem_id for p in small.problems(WORKER.peer_id, 0, k) for _ in range(GROUP)]
        assert small.check(WORKER.peer_id, 0, batch, GROUP) == k
        seen.update(batch)
    assert len(seen) == small.layout.windows * PER_BATCH  # no problem twice within a version
    # an honest worker making two windows a version meets no problem twice over 60 versions
    made = [p.problem_id for v in range(60) for k in range(2) for p in a.problems(WORKER.peer_id, v, k)]
    assert len(made) == len(set(made)) == 60 * 2 * PER_BATCH


def test_a_small_task_still_gives_whole_windows() -> None:
    """Fewer problems than (async_level + 1) x problems_per_batch: one region, windows recur by version;
    fewer than problems_per_batch: a window is the whole task."""
    small = _assignments(AdditionTask(1), per=4)  # 100 problems: regions of 33 positions
    lay = small.layout
    assert (lay.regions, lay.slots, lay.windows, lay.stride) == (3, 8, 8, 4)
    tiny = _assignments(AdditionTask(1), per=64, async_level=2)  # 100 < 3 x 64
    assert tiny.layout.regions == 1 and tiny.layout.windows == 1
    ids = [p.problem_id for p in tiny.problems(WORKER.peer_id, 5, 0)]
    assert len(set(ids)) == 64
    whole = _assignments(AdditionTask(1), per=64, async_level=0)
    assert whole.layout.per_window == 64


def test_coverage_counts_the_windows_a_worker_skipped() -> None:
    from intellect_node.envs.assignment import Coverage

    cov = Coverage(workers=2, versions=2)
    for v, k in ((0, 0), (0, 1), (1, 1), (1, 3), (2, 0)):
        cov.add("w", v, k)
    cov.add("w", 2, 0)  # the same window again: counted once
    # v0: 0, 1 (none skipped); v1: 1, 3 (0 and 2 skipped, v1 folded into the totals); v2: 0
    assert cov.of("w") == {"submitted": 5, "skipped": 2, "unsubmitted_rate": 0.2857}
    cov.add("x", 0, 0)
    cov.add("y", 0, 0)  # past the bound: the oldest worker goes
    assert list(cov.report(8)) == ["x", "y"]


# -- the validator -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir()


def _records(engine: TorchEngine, problem_ids: list[str], version: int) -> list[RolloutRecord]:
    """An honest worker's records of ``problem_ids`` (a group each) at ``version``: derived seeds, real
    proofs, true rewards."""
    problems = [embedded_task().get(pid) for pid in problem_ids for _ in range(GROUP)]
    return generate_rollouts(engine, engine.loaded.tokenizer, problems, key=WORKER, run_id=RUN,
                             policy_version=version, checkpoint=CID,
                             sampling=SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=4))


def _validator(tmp: Path) -> Any:
    return validator_role(tmp, VALIDATOR, TRAINER.peer_id, problems_per_batch=PER_BATCH)


def _check(validator: Any, engine: TorchEngine, recs: list[RolloutRecord], version: int) -> BatchVerdict:
    cid, data = batch_bytes(recs, version)
    notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=version, n_rollouts=len(recs),
                           batch_bytes=len(data))
    validator.latest_announced = max(validator.latest_announced, version)
    checking = validator.verification._check_content(notice, WORKER.peer_id, data, (CID, engine))
    verdict: BatchVerdict = asyncio.run(checking)
    asyncio.run(validator.publication.publish(verdict, WORKER.peer_id))  # counted, charged
    return verdict


def test_a_worker_choosing_easy_problems_is_refused_and_charged(tmp_path: Path, engine: TorchEngine) -> None:
    validator = _validator(tmp_path)
    easy = _check(validator, engine, _records(engine, ["add3/0", "add3/1"], 0), 0)  # 000+000, 000+001
    assert not easy.accepted and easy.reason == "not_assigned", easy
    assert validator.reputation.rejections.get(WORKER.peer_id) == 1
    assert [r.split(": ")[1] for p, r in validator.rt.swarm.peerbook.rejections
            if p == WORKER.peer_id] == ["not_assigned"]


def test_a_window_made_again_under_the_next_version_is_refused(tmp_path: Path, engine: TorchEngine) -> None:
    validator = _validator(tmp_path)
    window = _window(0, 0)
    first = _check(validator, engine, _records(engine, window, 0), 0)
    assert first.accepted, first
    # The same problems under v1 (v1's own seeds, so new samples the worker could pick from): refused.
    again = _check(validator, engine, _records(engine, window, 1), 1)
    assert not again.accepted and again.reason == "not_assigned", again
    # What v1 assigns it is accepted.
    assert _check(validator, engine, _records(engine, _window(1, 0), 1), 1).accepted


def test_a_batch_holds_its_whole_window_and_nothing_else(tmp_path: Path, engine: TorchEngine) -> None:
    validator = _validator(tmp_path)
    w0, w1 = _window(0, 0), _window(0, 1)
    for problems in (w0[:1], [w0[0], w1[0]], w0 + w1[:1]):  # part of a window; two windows mixed; more
        verdict = _check(validator, engine, _records(engine, problems, 0), 0)
        assert not verdict.accepted and verdict.reason == "not_assigned", (problems, verdict)


def test_the_validator_reports_windows_never_submitted(tmp_path: Path, engine: TorchEngine) -> None:
    validator = _validator(tmp_path)
    for k in (1, 3):  # windows 0 and 2 dropped (say, their problems looked hard)
        assert _check(validator, engine, _records(engine, _window(0, k), 0), 0).accepted
    got = validator.status()["assignments_by_worker"][WORKER.peer_id]
    assert got == {"submitted": 2, "skipped": 2, "unsubmitted_rate": 0.5}
    json.dumps(validator.status())  # what status --json prints


# -- the trainer ---------------------------------------------------------------------------------------


def test_the_trainer_checks_the_assignment_again_at_admission(tmp_path: Path) -> None:
    """A validator that accepts anything: the trainer refuses a batch outside its worker's assignment
    itself, charges the worker, and counts the windows it admitted."""
    from intellect_node.roles.common.tasks import run_assignments

    cfg = config(TRAINER.peer_id, [VALIDATOR.peer_id])
    mine = run_assignments(cfg, embedded_task())
    own, later = (mine.problems(WORKER.peer_id, 0, k)[0].problem_id for k in (0, 2))
    batches = {"own": [record(WORKER, own, i) for i in range(GROUP)],
               "easy": [record(WORKER, "add3/0", i) for i in range(GROUP)],
               "again": [record(WORKER, own, i, version=1) for i in range(GROUP)],  # v0's window under v1
               "later": [record(WORKER, later, i) for i in range(GROUP)]}
    blobs = {name: batch_bytes(recs, recs[0].policy_version) for name, recs in batches.items()}

    async def main() -> tuple[list[str], dict[str, Any], list[tuple[str, str]]]:
        trainer = trainer_role(tmp_path, TRAINER, [VALIDATOR.peer_id], batches=dict(blobs.values()))
        trainer.version = 1  # v1 is out: batches of v0 and v1 are both fresh
        try:
            for name in ("own", "easy", "again", "later"):
                cid, data = blobs[name]
                version = batches[name][0].policy_version
                notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=version, n_rollouts=GROUP,
                                       batch_bytes=len(data))
                trainer.intake.on_notice((notice, WORKER.peer_id), WORKER.peer_id)
                accept = BatchVerdict(run_id=RUN, batch_cid=cid, worker=WORKER.peer_id,
                                      policy_version=version, accepted=True, n_accepted=GROUP, n_rejected=0)
                await trainer.intake.on_verdict(gossiped(VALIDATOR, accept), VALIDATOR.peer_id)
            return ([a.cid for a in trainer.admission.queue], trainer.status(),
                    trainer.rt.swarm.peerbook.rejections)
        finally:
            trainer.intake.prefetch.close()

    queued, status, charged = asyncio.run(main())
    assert queued == [blobs["own"][0], blobs["later"][0]]
    assert status["not_assigned_batches"] == 2
    assert [(p, r.split(": ")[1]) for p, r in charged] == [(WORKER.peer_id, "not_assigned")] * 2
    assert status["assignments_by_worker"][WORKER.peer_id] == {"submitted": 2, "skipped": 1,
                                                              "unsubmitted_rate": 0.3333}


# -- a run ------------------------------------------------------------------------------------------


def test_workers_that_choose_or_drop_problems_are_caught_in_a_run(tmp_path: Path) -> None:
    """A worker that picks the easiest problems is refused (``not_assigned``) and banned; a worker that
    drops every other window of its assignment has the rest accepted (the worker, the validator and the
    trainer each computed the same windows from their own config) and shows a rate of assignments never
    submitted of 0.5 at the validator and the trainer.

    In one process (``intellect_node.testing.roles``): the trainer, the validator and the two cheating
    workers (``tests.support.roles.cheater``: the real worker with its problems or windows changed)."""
    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.roles.validator.role import Validator
    from intellect_node.testing.roles import in_process_swarm, key_of, run_config
    from tests.support.roles import cheater
    from tests.support.wait import wait_until

    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=4, max_new_tokens=4, batches_per_version=2)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl)
    choose, skip = key_of("choose").peer_id, key_of("skip").peer_id

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            validator = await net.start("validator", cfg, Validator.for_runtime)
            for mode in ("choose", "skip"):
                await net.start(mode, cfg, cheater(mode).for_runtime)
            # The chooser's first verdict (each verdict adds a latency sample for its worker).
            await wait_until(lambda: choose in validator.status()["latency_s"], timeout=300,
                             what="a verdict on the chooser")
            assert validator.status()["reasons_by_worker"][choose][0] == "not_assigned", validator.status()
            await wait_until(lambda: validator.status()["banned"] >= 1, timeout=300,
                             what="the chooser banned")
            await wait_until(lambda: (trainer.status()["assignments_by_worker"].get(skip, {})
                                      .get("submitted", 0)) >= 2, timeout=300,
                             what="the skipper's batches admitted")
            assert not net.failures(), net.failures()
            return validator.status(), trainer.status()

    v, t = asyncio.run(main())
    assert set(v["reasons_by_worker"][choose]) == {"not_assigned"}, v
    assert skip not in v["rejections_by_worker"], v  # every window it did submit was accepted
    assert choose not in t["assignments_by_worker"], t
    for seen in (v["assignments_by_worker"][skip], t["assignments_by_worker"][skip]):
        assert seen["skipped"] == seen["submitted"] and seen["unsubmitted_rate"] == 0.5, (v, t)
