"""What peers can make a validator or the trainer remember is bounded, and the IDs they
supply reach verdicts, logs and the dashboard cleaned.

- the validator's rejections and reasons per worker are bounded maps, its status lists the latest ones,
  and ``validator/hops.jsonl`` is rotated;
- the trainer's decided batches and votes are kept for the fresh versions only, its consumed IDs for
  ``CONSUMED_KEEP_VERSIONS`` (what each checkpoint rewrites), its refusal counts in a bounded map;
- peer-supplied IDs in a refusal's detail lose control characters and are cut."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import BatchVerdict, RolloutNotice, check_verdict
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.seen import describe_key
from intellect_node.roles.trainer import role as trainer_mod
from intellect_node.roles.trainer.admission import Admission
from intellect_node.roles.trainer.batching import Accepted
from intellect_node.roles.validator import hops as hops_mod
from intellect_node.roles.validator import reputation as reputation_mod
from tests.security._roles_inproc import RUN, trainer_role, validator_role

TRAINER, VALIDATOR = SigningKey(bytes([41]) * 32), SigningKey(bytes([42]) * 32)


def test_validator_per_worker_state_and_status_are_bounded(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reputation_mod, "PEERS_KEPT", 50)
    monkeypatch.setattr(hops_mod, "HOPS_MAX_BYTES", 2000)
    validator = validator_role(tmp_path, VALIDATOR, TRAINER.peer_id, ban_after=1000)

    async def main() -> None:
        for i in range(120):
            worker = SigningKey(i.to_bytes(2, "big") * 16).peer_id
            notice = RolloutNotice(run_id=RUN, batch_cid=cid_of(b"%d" % i), policy_version=0, n_rollouts=2,
                                   batch_bytes=100)
            for _ in range(2):
                verdict = validator.verification.verdict(notice, worker, 0, 2, "seed", "forged")
                await validator.publication.publish(verdict, worker)

    asyncio.run(main())
    assert len(validator.reputation.rejections) <= 50 and len(validator.reputation.reasons) <= 50
    st = validator.status()
    assert len(st["rejections_by_worker"]) <= reputation_mod.STATUS_PEERS
    assert len(st["reasons_by_worker"]) <= reputation_mod.STATUS_PEERS
    hops = tmp_path / "validator" / "hops.jsonl"
    assert hops.stat().st_size <= 2000 + 400 and (tmp_path / "validator" / "hops.jsonl.1").exists()


def test_trainer_forgets_decisions_and_consumed_ids_past_the_window(tmp_path: Path) -> None:
    adm = Admission(quorum=1, async_level=2, groups_per_step=1)
    for v in range(10):
        adm.add(Accepted(f"b{v}", "w", v, [[]], v))
    adm.forget_below(9)
    assert sorted(adm.known.values()) == [7, 8, 9]

    async def main() -> tuple[int, int]:
        trainer = trainer_role(tmp_path, TRAINER, [VALIDATOR.peer_id])
        try:
            trainer.consumed = {f"c{v}": v for v in range(200)}
            trainer.version = 199
            trainer._forget_old()
            return len(trainer.consumed), min(trainer.consumed.values())
        finally:
            trainer.intake.prefetch.close()

    kept, oldest = asyncio.run(main())
    keep = trainer_mod.CONSUMED_KEEP_VERSIONS
    assert kept == keep + 1 and oldest == 199 - keep


def test_peer_supplied_ids_are_cleaned_in_details(tmp_path: Path) -> None:
    hostile = "add3/1\x1b[2J\x1b]0;pwned\x07" + "x" * 500
    shown = describe_key(f"s\0run\0worker\0{hostile}\0{0}")
    assert "\x1b" not in shown and "\x07" not in shown and len(shown) < 120
    validator = validator_role(tmp_path, VALIDATOR, TRAINER.peer_id)
    notice = RolloutNotice(run_id=RUN, batch_cid=cid_of(b"x"), policy_version=0, n_rollouts=2,
                           batch_bytes=100)
    verdict = validator.verification.verdict(notice, TRAINER.peer_id, 0, 2, "unknown_task",
                                 f"problem {hostile}\nnext line")
    check_verdict(verdict)  # what the protocol requires of every verdict: no control characters
    assert "\n" not in verdict.detail and "\x1b" not in verdict.detail
    json.dumps(verdict.detail)
    assert isinstance(verdict, BatchVerdict)
