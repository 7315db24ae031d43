"""A validator that could not judge a batch does not lose the worker's honest work.

``stale``, ``policy_version`` and ``reward_unjudged`` (a lagging validator, one without the policy, a
checker that ran out of time there) are not rejections: at the trainer they decide nothing while another
validator can (the batch waits for a deciding verdict or goes stale), and at the validator they are not
remembered as the batch's outcome, so the same bytes sent again are checked again, never answered from
memory or as a ``duplicate``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import NOT_WORKERS_FAULT, BatchVerdict, RolloutNotice
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.trainer.admission import Admission
from tests.security._roles_inproc import (
    RUN,
    FakeFetcher,
    assigned,
    batch_bytes,
    record,
    trainer_role,
    validator_role,
)
from tests.support.verdicts import gossiped

TRAINER, V1, V2, WORKER = (SigningKey(bytes([i]) * 32) for i in range(11, 15))


def _verdict(cid: str, *, reason: str = "", version: int = 0, worker: str = WORKER.peer_id) -> BatchVerdict:
    ok = not reason
    return BatchVerdict(run_id=RUN, batch_cid=cid, worker=worker, policy_version=version, accepted=ok,
                        n_accepted=2 if ok else 0, n_rejected=0 if ok else 2, reason=reason)


@pytest.mark.parametrize("reason", sorted(NOT_WORKERS_FAULT))
def test_an_undecided_verdict_leaves_the_batch_to_another_validator(reason: str) -> None:
    adm = Admission(quorum=1, async_level=2, groups_per_step=4)
    def decide(adm: Admission, v: BatchVerdict, validator: str) -> str:
        return adm.decide(v, validator, version=0, consumed=False, banned=False)

    assert decide(adm, _verdict("b", reason=reason), "v1") == "abstain"
    assert decide(adm, _verdict("b"), "v2") == "admit"
    # With a quorum of 2 it is not a rejection either: the batch waits for the acceptances.
    adm = Admission(quorum=2, async_level=2, groups_per_step=4)
    assert decide(adm, _verdict("c", reason=reason), "v1") == "abstain"
    assert decide(adm, _verdict("c"), "v2") == "wait"
    assert decide(adm, _verdict("c"), "v3") == "admit"


def test_a_pending_batch_expires_when_it_goes_stale() -> None:
    adm = Admission(quorum=2, async_level=2, groups_per_step=4)
    assert adm.decide(_verdict("d", version=1), "v1", version=1, consumed=False, banned=False) == "wait"
    assert len(adm.tally) == 1
    adm.forget_below(4)  # the trainer moved to v4: v1 is below its fresh floor (2)
    assert len(adm.tally) == 0 and not adm.known


def test_the_trainer_trains_on_a_batch_a_lagging_validator_could_not_judge(tmp_path: Path) -> None:
    recs = [record(WORKER, assigned(WORKER), i) for i in range(2)]
    cid, data = batch_bytes(recs)

    async def main() -> tuple[list[str], dict[str, int], list[tuple[str, str]]]:
        trainer = trainer_role(tmp_path, TRAINER, [V1.peer_id, V2.peer_id], batches={cid: data})
        try:
            notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=2,
                                   batch_bytes=len(data))
            trainer.intake.on_notice((notice, WORKER.peer_id), WORKER.peer_id)
            await trainer.intake.on_verdict(gossiped(V1, _verdict(cid, reason="policy_version")), V1.peer_id)
            await trainer.intake.on_verdict(gossiped(V2, _verdict(cid)), V2.peer_id)
            return ([a.cid for a in trainer.admission.queue], dict(trainer.intake.counts),
                    trainer.rt.swarm.peerbook.rejections)
        finally:
            trainer.intake.prefetch.close()

    queued, counts, charged = asyncio.run(main())
    assert queued == [cid]
    assert counts["rejected_batches"] == 0 and counts["abstained_verdicts"] == 1
    assert charged == []


def test_the_validator_checks_the_same_bytes_again_after_an_undecided_verdict(tmp_path: Path) -> None:
    recs = [record(WORKER, assigned(WORKER), i) for i in range(2)]
    _, data = batch_bytes(recs)
    validator = validator_role(tmp_path, V1, TRAINER.peer_id)
    validator.fetcher = FakeFetcher(data)
    validator.engines[0] = ("policy-hash", object())
    validator.latest_announced = 0
    calls: list[str] = []

    async def check_content(notice: RolloutNotice, worker: str, data: bytes, held: Any) -> BatchVerdict:
        calls.append(notice.batch_cid)
        # The first time this validator's checker runs out of time; the second time it gets through.
        reason = "reward_unjudged" if len(calls) == 1 else ""
        verdict: BatchVerdict = validator.verification.verdict(notice, worker, 0 if reason else 2,
                                                               2 if reason else 0, reason)
        return verdict

    validator.verification._check_content = check_content
    # The same bytes under two blob names (the worker sent them again once the validator caught up).
    first, again = (RolloutNotice(run_id=RUN, batch_cid=c, policy_version=0, n_rollouts=2,
                                  batch_bytes=len(data)) for c in (batch_bytes(recs)[0], cid_of(b"again")))

    async def main() -> tuple[BatchVerdict, BatchVerdict]:
        checks = validator.verification
        return await checks.check(first, WORKER.peer_id), await checks.check(again, WORKER.peer_id)

    v1, v2 = asyncio.run(main())
    assert v1.reason == "reward_unjudged"
    assert v2.accepted, v2  # checked again, not "the same batch as ..." nor a duplicate
    assert len(calls) == 2


def test_unjudged_batches_are_bounded_per_worker_and_version(tmp_path: Path) -> None:
    """A batch whose answer runs the checker out of time gets ``reward_unjudged``
    (never held against the worker), and the same bytes under a new blob name are checked again. Without
    a bound, a worker re-sending it forever costs the validator a scoring time limit (and a scorer
    restart) each time, at no cost of its own. Now each worker has ``validator.unjudged_per_version``
    unjudged batches per version at a validator: past it, queued ones are answered ``reward_unjudged``
    unscored and unfetched, and new notices at that version are not taken in (recorded, not a strike)."""
    recs = [record(WORKER, assigned(WORKER), i) for i in range(2)]
    _, data = batch_bytes(recs)
    validator = validator_role(tmp_path, V1, TRAINER.peer_id)
    validator.fetcher = FakeFetcher(data)
    validator.engines[0] = validator.engines[1] = ("policy-hash", object())
    validator.latest_announced = 1
    budget = validator.vcfg.unjudged_per_version
    checked: list[int] = []

    async def check_content(notice: RolloutNotice, worker: str, data: bytes, held: Any) -> BatchVerdict:
        checked.append(notice.policy_version)  # its checker runs out of time on every copy
        verdict: BatchVerdict = validator.verification.verdict(notice, worker, 0, 2, "reward_unjudged",
                                                               "the checker timed out here")
        return verdict

    validator.verification._check_content = check_content

    def notice(name: str, version: int = 0) -> RolloutNotice:
        return RolloutNotice(run_id=RUN, batch_cid=cid_of(name.encode()), policy_version=version,
                             n_rollouts=2, batch_bytes=len(data))

    async def main() -> list[BatchVerdict]:
        return [await validator.verification.check(notice(f"again-{i}"), WORKER.peer_id)
                for i in range(budget + 5)]

    verdicts = asyncio.run(main())
    assert checked == [0] * budget  # scored while the budget lasted, then not any more
    assert {v.reason for v in verdicts} == {"reward_unjudged"} and not any(v.ban for v in verdicts)
    assert validator.verification.counts["unjudged_budget"] == 5
    assert validator.status()["unjudged_budget"] == 5
    validator._on_notice((notice("one-more"), WORKER.peer_id), WORKER.peer_id)  # not taken in
    assert validator.verification.counts["unjudged_budget"] == 6 and validator.intake.queued() == 0
    assert "unjudged_budget" in (validator.rt.swarm.peerbook.last_rejection(WORKER.peer_id) or "")
    workers = validator.reputation
    assert workers.strikes.get(WORKER.peer_id) is None and workers.rejections.get(WORKER.peer_id) is None
    # The next version is a fresh budget, and another worker has its own.
    asyncio.run(validator.verification.check(notice("next", 1), WORKER.peer_id))
    asyncio.run(validator.verification.check(notice("theirs"), V2.peer_id))
    assert checked == [0] * budget + [1, 0]
