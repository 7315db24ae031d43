"""Work of another task is refused as ``wrong_task``.

The embedded ``add3`` task is always registered and every registered task resolves its own problem IDs,
so in a run on a task file an ``add3`` batch resolved, verified and built its worker's trust. The
validator and the trainer now check every record against the run's task first."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from intellect_node.protocol.rl import BatchVerdict, RolloutNotice
from intellect_node.protocol.signing import SigningKey
from tests.security._roles_inproc import RUN, batch_bytes, record, trainer_role, validator_role
from tests.support.verdicts import gossiped

TRAINER, VALIDATOR, WORKER = (SigningKey(bytes([i]) * 32) for i in range(21, 24))


def _tasks_file(tmp: Path) -> str:
    path = tmp / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "checker": "integer"})
                            + "\n" for i in range(10)))
    return str(path)


def test_the_validator_refuses_another_tasks_batch(tmp_path: Path) -> None:
    validator = validator_role(tmp_path, VALIDATOR, TRAINER.peer_id, tasks_file=_tasks_file(tmp_path))
    assert validator.task.task_id == "sums"
    checks = validator.verification
    for recs in ([record(WORKER, "add3/7", i) for i in range(2)],  # the always-registered embedded task
                 [record(WORKER, "sums/3", i, task_id="add3") for i in range(2)]):  # a task ID that lies
        cid, data = batch_bytes(recs)
        notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=2,
                               batch_bytes=len(data))
        verdict = asyncio.run(checks._check_content(notice, WORKER.peer_id, data, ("policy-hash", None)))
        assert verdict.reason == "wrong_task", verdict
    assert not validator.reputation.trust.get(WORKER.peer_id)
    # The run's own task passes this check (and goes on to the seeds, which these records do not have).
    cid, data = batch_bytes([record(WORKER, "sums/3", i) for i in range(2)])
    notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=2, batch_bytes=len(data))
    verdict = asyncio.run(checks._check_content(notice, WORKER.peer_id, data, ("policy-hash", None)))
    assert verdict.reason == "seed", verdict


def test_the_trainer_refuses_another_tasks_batch_its_validator_accepted(tmp_path: Path) -> None:
    recs = [record(WORKER, "add3/7", i) for i in range(2)]
    cid, data = batch_bytes(recs)

    async def main() -> tuple[list[str], dict[str, int], list[tuple[str, str]], int]:
        trainer = trainer_role(tmp_path, TRAINER, [VALIDATOR.peer_id], batches={cid: data},
                               tasks_file=_tasks_file(tmp_path))
        try:
            notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=2,
                                   batch_bytes=len(data))
            trainer.intake.on_notice((notice, WORKER.peer_id), WORKER.peer_id)
            accept = BatchVerdict(run_id=RUN, batch_cid=cid, worker=WORKER.peer_id, policy_version=0,
                                  accepted=True, n_accepted=2, n_rejected=0)
            await trainer.intake.on_verdict(gossiped(VALIDATOR, accept), VALIDATOR.peer_id)
            return ([a.cid for a in trainer.admission.queue], dict(trainer.intake.counts),
                    trainer.rt.swarm.peerbook.rejections, len(trainer.admission.tally))
        finally:
            trainer.intake.prefetch.close()

    queued, counts, charged, pending = asyncio.run(main())
    assert queued == [] and pending == 0  # decided: refused, not left to be retried
    assert counts["wrong_task_batches"] == 1 and counts["accepted_batches"] == 0
    assert [(p, r.split(": ")[1]) for p, r in charged] == [(WORKER.peer_id, "wrong_task")]
