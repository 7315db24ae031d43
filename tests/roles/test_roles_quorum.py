"""The trainer's verdict quorum (``run.verdict_quorum``): how many trusted validators must accept a batch
before it is trained on, and what a rejection does."""

from __future__ import annotations

from pathlib import Path

import pytest

from intellect_node.config import load_config
from intellect_node.errors import ConfigError
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.trainer.batching import VerdictTally


def test_quorum_of_distinct_acceptances_and_rejection_first_refuses() -> None:
    t = VerdictTally(quorum=2)
    assert t.vote("b1", "v1", True) == "wait"
    assert t.vote("b1", "v1", True) == "wait"  # the same validator twice is one vote
    assert t.vote("b1", "v2", True) == "admit"
    # A failed admission keeps the votes: the next acceptance admits again; done() forgets the batch.
    assert t.vote("b1", "v3", True) == "admit"
    t.done("b1")
    assert t.vote("b1", "v3", True) == "wait"
    # One faulty validator's acceptance alone never admits; a rejection refuses.
    assert t.vote("b2", "bad", True) == "wait"
    assert t.vote("b2", "v1", False) == "refuse"
    assert VerdictTally(quorum=1).vote("b3", "v1", True) == "admit"


def test_tally_is_bounded() -> None:
    t = VerdictTally(quorum=2, limit=100)
    for i in range(1000):
        t.vote(f"b{i}", "v1", True)
    assert len(t._votes) <= 100
    assert t.vote("b999", "v2", True) == "admit"  # the newest counts are the ones kept


def test_quorum_larger_than_the_validator_list_is_an_operator_error(tmp_path: Path) -> None:
    ids = [SigningKey(bytes([i]) * 32).peer_id for i in (1, 2)]
    ok = tmp_path / "ok.toml"
    ok.write_text(f'[run]\nvalidator_peer_ids = {ids!r}\nverdict_quorum = 2\n'.replace("'", '"'))
    assert load_config(ok, environ={}).run.verdict_quorum == 2
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[run]\nvalidator_peer_ids = {ids[:1]!r}\nverdict_quorum = 2\n'.replace("'", '"'))
    with pytest.raises(ConfigError) as e:
        load_config(bad, environ={})
    assert "verdict_quorum" in str(e.value) and "validator_peer_ids" in str(e.value)


def test_a_quorum_of_two_trains_only_on_batches_both_validators_accepted(tmp_path: Path) -> None:
    """In one process (``intellect_node.testing.roles``): with ``verdict_quorum = 2`` the trainer does not
    train on batches that only one validator has accepted; once the second validator is up, it trains."""
    import asyncio
    from typing import Any

    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.roles.validator.role import Validator
    from intellect_node.roles.worker.role import Worker
    from intellect_node.testing.roles import in_process_swarm, key_of, run_config
    from tests.support.wait import wait_until

    # Three batches a version: the second validator never hears the notices sent before it started, and
    # the worker's later batches of v0 are the ones both validators judge.
    rl = dict(group_size=8, problems_per_batch=4, groups_per_step=4, max_new_tokens=5, batches_per_version=3)
    validators = [key_of("va").peer_id, key_of("vb").peer_id]
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=validators, rl=rl, verdict_quorum=2)

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            va = await net.start("va", cfg, Validator.for_runtime)
            await net.start("w", cfg, Worker.for_runtime)
            # Validator A's acceptances reach the trainer, which holds them until a second one comes.
            await wait_until(lambda: trainer.status()["awaiting_quorum"] >= 1, timeout=300,
                             what="a batch accepted by validator A alone")
            st = trainer.status()
            assert st["step"] == 0 and st["accepted_batches"] == 0, st

            vb = await net.start("vb", cfg, Validator.for_runtime)
            await wait_until(lambda: trainer.status()["step"] >= 2, timeout=300, what="2 trained steps")
            assert not net.failures(), net.failures()
            return trainer.status(), va.status(), vb.status()

    st, a, b = asyncio.run(main())
    # Every admitted batch was accepted by both; none was rejected by either.
    assert st["accepted_batches"] >= 2 and st["rejected_batches"] == 0
    assert a["accepted"] >= st["accepted_batches"] and b["accepted"] >= st["accepted_batches"]
    assert a["rejected"] == 0 and b["rejected"] == 0
