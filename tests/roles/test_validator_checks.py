"""The validator's cheap batch checks (``roles/validator/checks.py``), called as the pure function they
are: an honest batch passes with its groups and keys; each way of breaking a rule is named by the check
that catches it, and the first rule broken names the batch."""

from __future__ import annotations

import msgspec
import pytest

from intellect_node.envs.assignment import Assignments
from intellect_node.envs.tasks import embedded_task
from intellect_node.proofs.sampling import batch_seeds, derived_rollout_id
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import RolloutNotice
from intellect_node.protocol.rollout import RolloutBatch, RolloutRecord, SamplingParams, sign_rollout
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.seen import SeenRollouts
from intellect_node.roles.validator.checks import BatchRules, Fault, Passed, check_batch

RUN = "checks"
WORKER, OTHER = SigningKey(bytes([51]) * 32), SigningKey(bytes([52]) * 32)
ASSIGNED = Assignments(embedded_task(), RUN, problems_per_batch=2, async_level=1, windows_per_version=8)
RULES = BatchRules(run_id=RUN, group_size=2, task=embedded_task(), assignments=ASSIGNED)
P = tuple(p.problem_id for p in ASSIGNED.problems(WORKER.peer_id, 0, 0))  # the worker's first window
W1 = tuple(p.problem_id for p in ASSIGNED.problems(WORKER.peer_id, 0, 1))  # its second
NOT_P = tuple(p.problem_id for p in ASSIGNED.problems(WORKER.peer_id, 1, 0))  # of v1's region, not v0's


def records(key: SigningKey = WORKER, problems: tuple[str, ...] = (P[0], P[0], P[1], P[1]),
            version: int = 0) -> list[RolloutRecord]:
    """Records with the seeds and rollout IDs the run derives (their tokens are not what is checked)."""
    seeds = batch_seeds(RUN, version, key.peer_id, list(problems))
    return [sign_rollout(RolloutRecord(
        run_id=RUN, rollout_id=derived_rollout_id(key.peer_id, s), task_id=pid.split("/")[0], problem_id=pid,
        prompt_tokens=[1, 2], completion_tokens=[3], logprobs=[-1.0],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=s),
        policy_version=version, checkpoint_cid=cid_of(b"policy"), dtype="float32", reward=0.0, proofs=[b"p"],
        worker=key.peer_id), key)
        for pid, s in zip(problems, seeds)]


def check(recs: list[RolloutRecord], *, worker: str = WORKER.peer_id, n: int | None = None,
          run_id: str = RUN, seen: SeenRollouts | None = None) -> Fault | Passed:
    batch = RolloutBatch(run_id=run_id, policy_version=0, rollouts=recs)
    notice = RolloutNotice(run_id=RUN, batch_cid=cid_of(b"batch"), policy_version=0,
                           n_rollouts=len(recs) if n is None else n, batch_bytes=100)
    return check_batch(batch, notice, worker, RULES, seen or SeenRollouts())


def test_an_honest_batch_passes_with_its_groups_and_keys() -> None:
    got = check(records())
    assert isinstance(got, Passed) and got.window == 0
    assert got.groups == [slice(0, 2), slice(2, 4)] and len(got.keys) == 8


@pytest.mark.parametrize(("reason", "broken"), [
    ("malformed", lambda: check(records(), n=6)),
    ("malformed", lambda: check(records(), run_id="another-run")),
    ("bad_signature", lambda: check(records(), worker=OTHER.peer_id)),
    ("groups", lambda: check(records(problems=("add3/7", "add3/7", "add3/9")))),
    ("groups", lambda: check(records(problems=("add3/7", "add3/9")))),
    ("wrong_task", lambda: check(records(problems=("add2/7", "add2/7")))),
    ("wrong_task", lambda: check(records(problems=("add3/01", "add3/01")))),
    ("seed", lambda: check([sign_rollout(msgspec.structs.replace(
        r, sampling=msgspec.structs.replace(r.sampling, seed=r.sampling.seed + 1)), WORKER)
        for r in records()])),
    ("not_assigned", lambda: check(records(problems=(NOT_P[0], NOT_P[0], NOT_P[1], NOT_P[1])))),
    ("not_assigned", lambda: check(records(problems=(P[0], P[0], W1[1], W1[1])))),
    ("not_assigned", lambda: check(records(problems=(P[0], P[0])))),
])
def test_each_broken_rule_is_named(reason: str, broken: object) -> None:
    got = broken()  # type: ignore[operator]  # calling a check that is not callable, on purpose
    assert isinstance(got, Fault) and got.reason == reason, got


def test_rollouts_already_counted_make_a_duplicate_and_are_only_looked_up() -> None:
    recs = records()
    seen = SeenRollouts()
    first = check(recs, seen=seen)
    assert isinstance(first, Passed) and len(seen) == 0  # the caller reserves the keys, not the check
    seen.add(0, first.keys)
    again = check(recs, seen=seen)  # the same records again (under another blob name)
    assert isinstance(again, Fault) and again.reason == "duplicate"
    assert again.detail == f"sample 0 of {P[0]} at v0 was already counted"


def test_the_first_broken_rule_names_the_batch() -> None:
    """Another worker's records in broken groups: the signer rule comes first."""
    got = check(records(key=OTHER, problems=("add3/7", "add3/9")))
    assert isinstance(got, Fault) and got.reason == "bad_signature"
