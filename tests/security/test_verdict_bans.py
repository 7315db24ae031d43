"""One validator cannot ban anyone at the trainer.

A verdict's ``ban`` is one validator's vote; the trainer bans a worker only when ``run.verdict_quorum``
validators say so, each about a batch the worker itself announced (the trainer heard its signed notice);
the run's trainer and validators are never banned by verdicts. Verdicts carry the time they were sealed
and are acted on only inside a window around the trainer's clock (a replayed old ban does nothing), and
a verdict must be published by its signer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from intellect_node.errors import ProtocolError
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import (
    VERDICT_MAX_AGE_MS,
    VERDICT_MAX_AHEAD_MS,
    BatchVerdict,
    RolloutNotice,
    now_ms,
    seal_verdict,
    verdict_time_error,
    verdict_validator,
)
from intellect_node.protocol.signing import SigningKey
from tests.security._roles_inproc import RUN, trainer_role
from tests.support.verdicts import gossiped

TRAINER, V1, V2, WORKER, BYSTANDER = (SigningKey(bytes([i]) * 32) for i in range(1, 6))


def _ban(worker: str, cid: str, *, time_ms: int | None = None) -> BatchVerdict:
    return BatchVerdict(run_id=RUN, batch_cid=cid, worker=worker, policy_version=0, accepted=False,
                        n_accepted=0, n_rejected=2, reason="seed", detail="forged seeds", ban=True,
                        time_ms=now_ms() if time_ms is None else time_ms)


def _notice(cid: str) -> RolloutNotice:
    return RolloutNotice(run_id=RUN, batch_cid=cid, policy_version=0, n_rollouts=2, batch_bytes=100)


def _run(tmp: Path, quorum: int, body: Any) -> Any:
    async def main() -> Any:
        trainer = trainer_role(tmp, TRAINER, [V1.peer_id, V2.peer_id], quorum=quorum)
        try:
            return await body(trainer)
        finally:
            trainer.intake.prefetch.close()
    return asyncio.run(main())


def test_one_validator_bans_neither_the_run_nor_a_peer_whose_batch_it_is_not(tmp_path: Path) -> None:
    async def body(trainer: Any) -> dict[str, str]:
        # A hostile (or broken) trusted validator names the other validator, the trainer, and a peer that
        # announced no such batch.
        for target in (V2.peer_id, TRAINER.peer_id, BYSTANDER.peer_id):
            await trainer.intake.on_verdict(gossiped(V1, _ban(target, cid_of(target.encode()))), V1.peer_id)
        assert trainer.rt.swarm.banned == {}
        # A worker's own announced batch: one validator is the quorum of 1 here, so the ban stands.
        cid = cid_of(b"worker batch")
        trainer.intake.on_notice((_notice(cid), WORKER.peer_id), WORKER.peer_id)
        await trainer.intake.on_verdict(gossiped(V1, _ban(WORKER.peer_id, cid)), V1.peer_id)
        return dict(trainer.rt.swarm.banned)

    banned = _run(tmp_path, 1, body)
    assert list(banned) == [WORKER.peer_id]


def test_a_ban_takes_the_quorum_of_distinct_validators(tmp_path: Path) -> None:
    async def body(trainer: Any) -> list[dict[str, str]]:
        seen = []
        cids = [cid_of(b"b%d" % i) for i in range(3)]
        for cid in cids:
            trainer.intake.on_notice((_notice(cid), WORKER.peer_id), WORKER.peer_id)
        await trainer.intake.on_verdict(gossiped(V1, _ban(WORKER.peer_id, cids[0])), V1.peer_id)
        await trainer.intake.on_verdict(gossiped(V1, _ban(WORKER.peer_id, cids[1])), V1.peer_id)  # same voter
        seen.append(dict(trainer.rt.swarm.banned))
        await trainer.intake.on_verdict(gossiped(V2, _ban(WORKER.peer_id, cids[2])), V2.peer_id)
        seen.append(dict(trainer.rt.swarm.banned))
        return seen

    before, after = _run(tmp_path, 2, body)
    assert before == {} and list(after) == [WORKER.peer_id]


def test_a_replayed_old_ban_verdict_does_nothing(tmp_path: Path) -> None:
    cid = cid_of(b"old batch")

    async def body(trainer: Any) -> tuple[dict[str, str], dict[str, int]]:
        trainer.intake.on_notice((_notice(cid), WORKER.peer_id), WORKER.peer_id)
        old = _ban(WORKER.peer_id, cid, time_ms=now_ms() - VERDICT_MAX_AGE_MS - 60_000)
        ahead = _ban(WORKER.peer_id, cid, time_ms=now_ms() + VERDICT_MAX_AHEAD_MS + 60_000)
        for v in (old, ahead):
            await trainer.intake.on_verdict(gossiped(V1, v), V1.peer_id)
        return dict(trainer.rt.swarm.banned), dict(trainer.intake.counts)

    banned, counts = _run(tmp_path, 1, body)
    assert banned == {}
    assert counts["expired_verdicts"] == 2 and counts["rejected_batches"] == 0  # nothing decided either


def test_verdict_time_window() -> None:
    now = 1_800_000_000_000
    fresh = _ban(WORKER.peer_id, cid_of(b"x"), time_ms=now - 5_000)
    assert verdict_time_error(fresh, now) == ""
    assert "ago" in verdict_time_error(
        _ban(WORKER.peer_id, cid_of(b"x"), time_ms=now - VERDICT_MAX_AGE_MS - 1), now)
    assert "ahead" in verdict_time_error(
        _ban(WORKER.peer_id, cid_of(b"x"), time_ms=now + VERDICT_MAX_AHEAD_MS + 1), now)


def test_a_verdict_published_by_another_peer_than_its_signer_is_refused() -> None:
    """Honest: the validator publishes its own verdict. Mallory: publishes the validator's signed verdict
    as its own message (after the gossip seen-cache forgot it)."""
    raw = seal_verdict(V1, _ban(WORKER.peer_id, cid_of(b"y")))
    validate = verdict_validator(RUN, frozenset({V1.peer_id, V2.peer_id}))
    assert validate(raw, V1.peer_id)[1] == V1.peer_id
    with pytest.raises(ProtocolError, match="another peer than its publisher"):
        validate(raw, BYSTANDER.peer_id)
