"""Each rollout is admitted once: the validator's half (the trainer's, behind a lying validator and
across a SIGKILL, is ``test_roles_admission.py``'s, with real processes).

A worker that re-submits its rollouts under other blob names (the same bytes, and the same records
reordered) gets them refused as ``duplicate`` by the validator, without a second verification, and is
banned after ``rl.ban_after`` of them; the trainer admits each batch once. Its first batch is verified in
full, the next on ``rl.verify_fraction``'s sample (``rl.verify_first_batches``).

In one process (``intellect_node.testing.roles``): the trainer, the validator and the replaying worker
(``tests.support.roles.cheater("replay")``: the real worker, which gossips each batch again under two more
blob names) on one event loop, the blobs over their real bulk HTTP routes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.roles import cheater
from tests.support.wait import wait_until


def test_validator_refuses_resubmitted_rollouts_once_verified_and_bans(tmp_path: Path) -> None:
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=64, max_new_tokens=4, batches_per_version=4,
              ban_after=3, verify_fraction=0.5, verify_first_batches=1)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            validator = await net.start("validator", cfg, Validator.for_runtime)
            await net.start("cheat", cfg, cheater("replay").for_runtime)
            await wait_until(lambda: validator.status()["banned"] >= 1, timeout=400,
                             what="the replayer banned")
            await wait_until(lambda: trainer.status()["banned"] >= 1, timeout=60,
                             what="the ban at the trainer")
            # The accepted batches were prefetched on their notices; the ban verdict can overtake the
            # admission of the last one (its fetch still running), which then follows.
            await wait_until(lambda: trainer.status()["awaiting_quorum"] == 0, timeout=60,
                             what="the trainer done with the accepted batches")
            assert not net.failures(), net.failures()
            return validator.status(), trainer.status()

    vstat, tstat = asyncio.run(main())
    w = key_of("cheat").peer_id
    # batch 1 accepted; its exact copy and its reordered copy refused; batch 2 accepted; its copy refused
    # and the third duplicate bans.
    assert vstat["reasons_by_worker"][w] == ["duplicate"] * 3, vstat
    assert vstat["accepted"] == 2 and vstat["duplicate"] == 3, vstat
    assert vstat["reused"] == 2, vstat  # the exact copies: the earlier verdict, no decoding, no proofs
    assert vstat["verified"] == vstat["accepted"], vstat  # tensor checks ran once per accepted batch only
    assert vstat["verified_full"] == 1, vstat  # its first batch in full, then verify_fraction's sample
    assert tstat["accepted_batches"] == 2 and tstat["rejected_batches"] == 3, tstat
    assert tstat["duplicate_batches"] == 0, tstat  # the validator caught them first
