"""Each rollout is admitted once: the trainer's half, with real processes on loopback.

Behind a validator that accepts everything (a faulty validator the trainer was told to trust), the trainer
itself refuses the copies, also after a SIGKILL and restart (its journal of admitted rollouts), and
refuses a worker off the run's allowlist (``not_allowed``). Real processes, because the journal has to
outlive a killed process. The validator's half (copies refused as ``duplicate`` without a second
verification, then a ban) is ``test_roles_admission_validator.py``'s, in one process.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from intellect_node.protocol.rollout import decode_batch
from intellect_node.roles.common.seen import rollout_keys
from tests.support.roles import listen_addr, role_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _consumed_keys(trainer_dir: Path) -> list[str]:
    """Rollout keys of every batch the trainer consumed in an optimizer step (metrics.jsonl lines with
    ``trained``), read from its blob store. A step whose groups all had equal rewards writes a line with
    ``trained: false`` and hands its batches to the next checkpoint, so they are listed again there."""
    import json

    from intellect_node.blobs.store import BlobStore

    store = BlobStore(trainer_dir / "blobs")
    keys: list[str] = []
    for line in (trainer_dir / "trainer" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for cid in rec["batches"] if rec["trained"] else []:
            batch = decode_batch(bytes(store.read(cid)))
            keys += [f"{batch.policy_version}\0{k}" for k in rollout_keys(batch.rollouts)]
    return keys


def test_trainer_refuses_copies_behind_a_lying_validator_across_a_sigkill(tmp_path: Path) -> None:
    # checkpoint_every 2: the kill lands between checkpoints (after step 1), so the restarted trainer
    # replays its journal as well as re-reading the admitted keys.
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
              max_steps=3, ban_after=1000, checkpoint_every=2)
    with role_run(tmp_path, ("trainer", "stamp", "cheat"), rl=rl, validators=("stamp",), allowlist=("cheat",),
                  async_level=8) as run:
        ids = run.ids
        trainer = run.start("trainer", "trainer")
        t_addr = listen_addr(trainer)
        s_addr = listen_addr(run.hostile("stamp", "stamp-outsider", bootstrap=[t_addr]))
        cheat = run.cheat("cheat", "replay-first", bootstrap=[t_addr, s_addr])

        def before() -> dict[str, Any]:
            st = trainer.status()["trainer"]
            return st if st["step"] >= 1 and st["duplicate_batches"] >= 1 and st["not_allowed_batches"] >= 1 \
                else {}

        st1: Any = wait_for(before, timeout=400, what="a step, a refused copy and a refused stranger")
        # The copy of batch 1 came after batch 1 was consumed and its inbox entry dropped: the journal
        # is what remembers it now. Kill the trainer and check the restarted one still does.
        trainer.signal(signal.SIGKILL)
        trainer.wait(30)
        trainer2 = run.start("trainer", "trainer", bootstrap=[s_addr])
        trainer2.wait_ready(180)
        st2: Any = wait_for(lambda: (s := trainer2.status())["trainer"]["duplicate_batches"] >= 1 and s,
                            timeout=300, what="a copy refused after the restart")
        cstat = cheat.status()["worker"]
    assert st1["banned"] == 0 and st2["trainer"]["banned"] == 0  # ban_after 1000: refused, not banned yet
    book = {r["peer_id"]: r for r in st2["known_peers"]}
    refused = book[ids["cheat"]]["last_rejection"] or ""  # the restarted trainer's own record
    assert "duplicate" in refused, book[ids["cheat"]]
    # The copy refused after the restart is one the cheat made: a new one, or the first one again (gossip's
    # message cache can hand a trainer that restarts quickly the notices of the last few seconds). Either
    # way only the journal still knows those rollouts: the first copy's inbox entry went when it was refused.
    assert any(cid in refused for cid in cstat["copy_cids"]), (refused, cstat["copy_cids"])
    keys = _consumed_keys(tmp_path / "trainer")
    assert keys and len(keys) == len(set(keys)), "a rollout was trained on twice"
