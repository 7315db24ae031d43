"""The trainer and validator roles in this process, behind a fake swarm.

What these tests check happens inside one role once a message has arrived (which verdict bans whom, which
records a batch may hold), so the role is driven through its own gossip handlers with the messages a
hostile peer would send; the gossip and blob layers are stood in for by :class:`FakeSwarm` (bans and
rejections recorded, publications kept) and a prefetch that hands over the batch bytes given. The fakes
are the package's (``intellect_node.testing.roles``); what is here builds these tests' run and records.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from intellect_node.config import NodeConfig
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rollout import (
    RolloutBatch,
    RolloutRecord,
    SamplingParams,
    decode_batch,
    encode_batch,
    sign_rollout,
)
from intellect_node.protocol.signing import SigningKey
from intellect_node.testing.roles import FakeFetcher as FakeFetcher  # re-exported for the tests here
from intellect_node.testing.roles import FakeRuntime

RUN = "sec"
GROUP = 2


def config(trainer: str, validators: list[str], *, quorum: int = 1, **rl: Any) -> NodeConfig:
    return NodeConfig.model_validate({
        "run": {"run_id": RUN, "trainer_peer_id": trainer, "validator_peer_ids": validators,
                "verdict_quorum": quorum},
        "rl": {"group_size": GROUP, "problems_per_batch": 1, "groups_per_step": 4, "max_new_tokens": 4, **rl},
    })


def trainer_role(tmp: Path, key: SigningKey, validators: list[str], *, quorum: int = 1,
                 batches: dict[str, bytes] | None = None, **rl: Any) -> Any:
    """A :class:`~intellect_node.roles.trainer.role.Trainer` on a fake swarm, driven through
    ``trainer.intake``; ``batches`` (CID -> bytes) are what its prefetch hands over when it hears their
    notices."""
    from intellect_node.roles.trainer.prefetch import Prefetch
    from intellect_node.roles.trainer.role import Trainer

    rt = FakeRuntime(config(key.peer_id, validators, quorum=quorum, **rl), key, tmp)
    trainer = Trainer(rt)
    held = dict(batches or {})

    async def fetch(worker: str, cid: str, size: int) -> tuple[bytes, RolloutBatch]:
        if cid not in held:
            await asyncio.Event().wait()  # never served: the test does not expect it to be
        return held[cid], decode_batch(held[cid])

    trainer.intake.prefetch = Prefetch(fetch)
    return trainer


def assigned(key: SigningKey, version: int = 0, window: int = 0) -> str:
    """The problem of ``key``'s assignment window ``window`` at ``version`` in these tests' run (one
    problem a window): what an honest worker's batch holds (``envs/assignment.py``)."""
    from intellect_node.envs.tasks import embedded_task
    from intellect_node.roles.common.tasks import run_assignments

    (pid,) = (p.problem_id for p in run_assignments(config(key.peer_id, []), embedded_task())
              .problems(key.peer_id, version, window))
    return pid


def record(key: SigningKey, problem_id: str, index: int, *, task_id: str | None = None,
           signer: SigningKey | None = None, version: int = 0) -> RolloutRecord:
    """A structurally valid record of ``key``'s (signed by ``signer``, default ``key``)."""
    r = RolloutRecord(run_id=RUN, rollout_id=f"{key.peer_id[-8:]}-{problem_id}-{index}",
                      task_id=task_id or problem_id.rsplit("/", 1)[0], problem_id=problem_id,
                      prompt_tokens=[1, 2, 3], completion_tokens=[5, 6], logprobs=[-0.5, -0.5],
                      sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=index),
                      policy_version=version, checkpoint_cid=cid_of(b"policy"), dtype="float32", reward=0.0,
                      proofs=[b"p"], worker=key.peer_id)
    return sign_rollout(r, key) if signer is None else sign_rollout_as(r, key, signer)


def sign_rollout_as(r: RolloutRecord, named: SigningKey, signer: SigningKey) -> RolloutRecord:
    """``r`` naming ``named`` as its worker but signed by ``signer`` (a record planted under a name)."""
    import msgspec

    from intellect_node.protocol.rollout import ROLLOUT_DOMAIN

    unsigned = msgspec.structs.replace(r, worker=named.peer_id, signature=b"")
    signature = signer.sign_bytes(ROLLOUT_DOMAIN, unsigned.signed_payload())
    return msgspec.structs.replace(unsigned, signature=signature)


def batch_bytes(records: list[RolloutRecord], version: int = 0) -> tuple[str, bytes]:
    data = encode_batch(RolloutBatch(run_id=RUN, policy_version=version, rollouts=records))
    return cid_of(data), data


def validator_role(tmp: Path, key: SigningKey, trainer: str, **rl: Any) -> Any:
    """A :class:`~intellect_node.roles.validator.role.Validator` on a fake swarm, not started (no policy, no
    engines: a test hands it what a check needs)."""
    from intellect_node.roles.validator.role import Validator

    rt = FakeRuntime(config(trainer, [key.peer_id], **rl), key, tmp)
    return Validator(rt)
