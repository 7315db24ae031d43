"""Wire formats: msgspec structs, versioned protocol IDs and topics, one canonical encoding, signatures.

Nothing here imports torch, libp2p or trio. Every decoder raises only :class:`ProtocolError`.
One module per protocol, each declaring its structs, its protocol ID or topic and its maximum size:
``codec`` (the canonical encoding and strict decoding), ``signing`` (signed envelopes), ``freshness``
(dated messages outside their window, and repeats, are ignored, not refused), ``ids`` (peer and
content IDs), ``topics``; ``gossip`` (heartbeats, node info), ``blob`` (blob manifests, have bitmaps),
``rollout`` (rollout records), ``rl`` (batch notices and verdicts), ``policy`` (policy announcements and
deltas), ``steps`` (the trainer's step records), ``audits`` (auditors' verdicts), ``evals`` (held-out
evaluation results), ``binding`` (two hashes the trainer signed for one version: the proof),
``run_manifest`` (runs and their listings), ``feed`` (a node's signed metrics and held-out lines, for a
report made from the swarm) and ``sweep`` (sweep offers, claims, grants and results)."""

from intellect_node.errors import ProtocolError

__all__ = ["ProtocolError"]
