"""The trainer's verdict quorum (``run.verdict_quorum``): how many trusted validators must accept a batch
before it is trained on, and what a rejection does."""

from __future__ import annotations

from pathlib import Path

import pytest

from intellect_node.errors import ConfigError
from intellect_node.node.config import load_config
from intellect_node.node.roles.trainer import VerdictTally
from intellect_node.protocol.signing import SigningKey


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
