"""Hash bindings (gossip topic ``/intellect/<run_id>/conflicts/1``): one version, one checkpoint hash.

The run's trainer binds a policy version to a checkpoint hash in two kinds of signed message:

- its policy announcements (``protocol/policy.py``): the announced version's ``checkpoint_hash``, and
  for each delta link its ``target_hash`` (the link's version) and its ``base_hash`` (the version before);
- its step records (``protocol/steps.py``): ``base_version`` to ``base_hash`` and ``version`` to
  ``checkpoint_hash``.

Workers load what the announcements bind; auditors replay what the records bind. An honest trainer binds
each version to one hash for the whole run (an announced version keeps its content:
``roles/trainer/replay.py`` publishes a replay that came out otherwise as the next version), so the two
always agree. A trainer that trains an honest chain, signs records of it and announces other weights
(a backdoored policy) must sign two hashes for one version somewhere, and the two messages are the
proof: a :class:`HashConflict` carries both envelopes as the trainer sealed them, and anyone holding the
run's trainer ID checks it (:func:`open_conflict`: both signed by the trainer, of this run, consistent,
and binding ``version`` to two different hashes). The proof needs no signature of its own: a forged one
fails those checks and is refused as any malformed message is, blamed on the peer that sent it.

Bounds: the proof is two envelopes, each an announcement (at most ``MAX_ANNOUNCEMENT_BYTES``) or a
record (at most ``MAX_RECORD_BYTES``), plus a little framing (:data:`MAX_CONFLICT_BYTES`). A proof over
the gossip layer's own message limit is not gossiped (the node that found it keeps it and acts on it:
``roles/common/binding.py``).
"""

from __future__ import annotations

from typing import Callable

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.policy import (
    MAX_ANNOUNCEMENT_BYTES,
    POLICY_DOMAIN,
    PolicyAnnouncement,
    open_announcement,
)
from intellect_node.protocol.signing import ENVELOPE_OVERHEAD, Envelope
from intellect_node.protocol.steps import MAX_RECORD_BYTES, STEP_DOMAIN, StepRecord, open_record
from intellect_node.protocol.topics import validate_run_id

CONFLICT_KIND = "conflicts"  # the topic kind: /intellect/<run_id>/conflicts/1
MAX_ENVELOPE_BYTES = max(MAX_ANNOUNCEMENT_BYTES, MAX_RECORD_BYTES) + ENVELOPE_OVERHEAD
MAX_CONFLICT_BYTES = 2 * MAX_ENVELOPE_BYTES + 256


class HashConflict(codec.Message, frozen=True):
    run_id: str
    version: int  # the version the two envelopes bind to different hashes
    first: bytes  # a sealed policy announcement or step record of the run's trainer
    second: bytes  # another one


def announcement_bindings(ann: PolicyAnnouncement) -> dict[int, str]:
    """The version -> checkpoint hash pairs ``ann`` (checked) signs."""
    out: dict[int, str] = {}
    for link in ann.deltas:
        out.setdefault(link.version - 1, link.base_hash)
        out[link.version] = link.target_hash
    out[ann.version] = ann.checkpoint_hash
    return out


def record_bindings(rec: StepRecord) -> dict[int, str]:
    """The version -> checkpoint hash pairs ``rec`` (checked) signs."""
    return {rec.base_version: rec.base_hash, rec.version: rec.checkpoint_hash}


def open_bindings(data: bytes, *, run_id: str, trainer: str) -> tuple[str, dict[int, str]]:
    """Open ``data`` as a sealed announcement or step record of ``trainer`` for ``run_id`` (which one by
    its envelope's domain); ``(what it is, the bindings it signs)``. ProtocolError for anything else."""
    env = codec.decode(data, Envelope, max_size=MAX_ENVELOPE_BYTES)
    if env.domain == POLICY_DOMAIN:
        return "announcement", announcement_bindings(open_announcement(data, run_id=run_id, trainer=trainer))
    if env.domain == STEP_DOMAIN:
        return "record", record_bindings(open_record(data, run_id=run_id, trainer=trainer))
    raise ProtocolError(f"a {env.domain[:40]!r} envelope binds no policy version")


def conflict_hashes(c: HashConflict, *, run_id: str, trainer: str) -> tuple[str, str]:
    """The two hashes ``c`` proves the trainer signed for ``c.version``; ProtocolError unless it is a
    proof (module docstring)."""
    validate_run_id(c.run_id)
    if c.run_id != run_id:
        raise ProtocolError(f"hash conflict for run {c.run_id!r}, this node is in {run_id!r}")
    if c.first == c.second:
        raise ProtocolError("a hash conflict names the same message twice")
    hashes = []
    for data in (c.first, c.second):
        _, binds = open_bindings(data, run_id=run_id, trainer=trainer)
        if c.version not in binds:
            raise ProtocolError(f"a message of the hash conflict binds no hash to v{c.version}")
        hashes.append(binds[c.version])
    if hashes[0] == hashes[1]:
        raise ProtocolError(f"both messages bind v{c.version} to {hashes[0]}: no conflict")
    return hashes[0], hashes[1]


def seal_conflict(c: HashConflict, *, trainer: str) -> bytes:
    """The bytes to gossip (checked first: a node never sends a proof that is none)."""
    conflict_hashes(c, run_id=c.run_id, trainer=trainer)
    return codec.encode(c)


def open_conflict(data: bytes, *, run_id: str, trainer: str) -> tuple[HashConflict, tuple[str, str]]:
    """Decode and check a proof; the conflict and its two hashes."""
    c = codec.decode(data, HashConflict, max_size=MAX_CONFLICT_BYTES)
    return c, conflict_hashes(c, run_id=run_id, trainer=trainer)


def conflict_validator(run_id: str, trainer: str
                       ) -> Callable[[bytes, str], tuple[HashConflict, tuple[str, str], bytes]]:
    """A gossip validator: the conflict, its two hashes and the bytes as received (kept as evidence)."""

    def validate(data: bytes, from_peer: str) -> tuple[HashConflict, tuple[str, str], bytes]:
        c, hashes = open_conflict(data, run_id=run_id, trainer=trainer)
        return c, hashes, data

    return validate
