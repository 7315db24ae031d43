"""The trainer checks every record's signature at admission.

Without it one trusted validator could accept a batch it made itself, holding records that name an
honest worker (signed by someone else): the trainer admitted their rollout keys, then refused the
worker's real rollouts as duplicates and counted them against it, up to a ban."""

from __future__ import annotations

import asyncio
from pathlib import Path

from intellect_node.protocol.rl import BatchVerdict, RolloutNotice
from intellect_node.protocol.signing import SigningKey
from tests.security._roles_inproc import RUN, assigned, batch_bytes, record, trainer_role
from tests.support.verdicts import gossiped

TRAINER, VALIDATOR, WORKER, MALLORY = (SigningKey(bytes([i]) * 32) for i in range(31, 35))


def _accept(cid: str) -> BatchVerdict:
    return BatchVerdict(run_id=RUN, batch_cid=cid, worker=WORKER.peer_id, policy_version=0, accepted=True,
                        n_accepted=2, n_rejected=0)


def test_planted_records_are_refused_and_the_workers_real_batch_is_admitted(tmp_path: Path) -> None:
    # Mallory's batch: the worker's problem and sample indexes, the worker's name, mallory's signatures.
    pid = assigned(WORKER)
    planted_cid, planted = batch_bytes([record(WORKER, pid, i, signer=MALLORY) for i in range(2)])
    real_cid, real = batch_bytes([record(WORKER, pid, i) for i in range(2)])

    async def main() -> tuple[list[str], dict[str, int], list[tuple[str, str]], dict[str, str]]:
        trainer = trainer_role(tmp_path, TRAINER, [VALIDATOR.peer_id],
                               batches={planted_cid: planted, real_cid: real})
        try:
            for cid, data in ((planted_cid, planted), (real_cid, real)):
                notice = RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=2,
                                       batch_bytes=len(data))
                trainer.intake.on_notice((notice, WORKER.peer_id), WORKER.peer_id)
                await trainer.intake.on_verdict(gossiped(VALIDATOR, _accept(cid)), VALIDATOR.peer_id)
            return ([a.cid for a in trainer.admission.queue], dict(trainer.intake.counts),
                    trainer.rt.swarm.peerbook.rejections, dict(trainer.rt.swarm.banned))
        finally:
            trainer.intake.prefetch.close()

    queued, counts, charged, banned = asyncio.run(main())
    assert queued == [real_cid]
    assert counts["bad_signature_batches"] == 1 and counts["duplicate_batches"] == 0
    assert charged == [] and banned == {}  # nothing held against the worker whose name was used
