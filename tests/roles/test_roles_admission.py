"""Each rollout is admitted once, with real processes on loopback (issue #12, part 3).

- A worker that re-submits its rollouts under other blob names (the same bytes, and the same records
  reordered) gets them refused as ``duplicate`` by the validator, without a second verification, and is
  banned after ``rl.ban_after`` of them; the trainer admits each batch once. Its first batch is verified
  in full, the next on ``rl.verify_fraction``'s sample (``rl.verify_first_batches``).
- Behind a validator that accepts everything (a faulty validator the trainer was told to trust), the
  trainer itself refuses the copies, also after a SIGKILL and restart (its journal of admitted rollouts),
  and refuses a worker off the run's allowlist (``not_allowed``).
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


def test_validator_refuses_resubmitted_rollouts_once_verified_and_bans(tmp_path: Path) -> None:
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=64, max_new_tokens=4, batches_per_version=4,
              ban_after=3, verify_fraction=0.5, verify_first_batches=1)
    with role_run(tmp_path, ("trainer", "validator", "cheat"), rl=rl) as run:
        trainer, t_addr, validator, v_addr = run.trainer_and_validator()
        run.cheat("cheat", "replay", bootstrap=[t_addr, v_addr])
        wait_for(lambda: validator.status()["validator"]["banned"] >= 1, timeout=400,
                 what="the replayer banned")
        wait_for(lambda: trainer.status()["trainer"]["banned"] >= 1, timeout=60,
                 what="the ban at the trainer")
        # The accepted batches were prefetched on their notices; the ban verdict can overtake the
        # admission of the last one (its fetch still running), which then follows.
        wait_for(lambda: trainer.status()["trainer"]["awaiting_quorum"] == 0, timeout=60,
                 what="the trainer done with the accepted batches")
        vstat = validator.status()["validator"]
        tstat = trainer.status()["trainer"]
    w = run.ids["cheat"]
    # batch 1 accepted; its exact copy and its reordered copy refused; batch 2 accepted; its copy refused
    # and the third duplicate bans.
    assert vstat["reasons_by_worker"][w] == ["duplicate"] * 3, vstat
    assert vstat["accepted"] == 2 and vstat["duplicate"] == 3, vstat
    assert vstat["reused"] == 2, vstat  # the exact copies: the earlier verdict, no decoding, no proofs
    assert vstat["verified"] == vstat["accepted"], vstat  # tensor checks ran once per accepted batch only
    assert vstat["verified_full"] == 1, vstat  # its first batch in full, then verify_fraction's sample
    assert tstat["accepted_batches"] == 2 and tstat["rejected_batches"] == 3, tstat
    assert tstat["duplicate_batches"] == 0, tstat  # the validator caught them first


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
