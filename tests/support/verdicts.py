"""Verdicts as the trainer's intake receives them: the decoded verdict, its signer and the sealed envelope."""

from __future__ import annotations

from intellect_node.protocol.rl import BatchVerdict, seal_verdict
from intellect_node.protocol.signing import SigningKey


def gossiped(key: SigningKey, verdict: BatchVerdict) -> tuple[BatchVerdict, str, bytes]:
    """``verdict`` signed by ``key``, as ``BatchIntake.on_verdict`` gets it from the gossip validator."""
    return verdict, key.peer_id, seal_verdict(key, verdict)
