"""Policy announcements (gossip topic ``/intellect/<run_id>/policy/1``) and the delta blob's structs.

The trainer announces each policy version ``v`` with one signed :class:`PolicyAnnouncement`:

- ``checkpoint_hash``: CID of version v's canonical checkpoint bytes (``policy/weights.py`` defines
  the format); every path to version v ends with this check;
- ``full_version``/``full_cid``: the latest full checkpoint blob at or before v (v itself every K
  versions), so a late joiner can start there;
- ``deltas``: the links ``full_version+1 .. v`` (at least the link for v itself when v > 0), each the blob
  CID of the delta from the previous version with the hashes it leads from and to. A worker that holds
  any version on that chain walks forward from it; one that holds nothing usable fetches the full
  checkpoint and walks the chain from there.

Only the run's trainer may announce: :func:`open_announcement` is the check, made where announcements are
received (the gossip validator), together with the run ID and the chain's internal consistency.
"""

from __future__ import annotations

from typing import Callable, Final, Literal

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import validate_cid
from intellect_node.protocol.signing import SigningKey, open_from_trainer

POLICY_DOMAIN = "intellect/policy/1"
POLICY_KIND = "policy"  # the topic kind: /intellect/<run_id>/policy/1
MAX_CHAIN = 64
"""Most delta links one announcement carries, hence the largest allowed full-checkpoint interval K."""
MAX_ANNOUNCEMENT_BYTES = 48 * 1024
"""64 links of ~ 300 bytes plus the rest; far below gossipsub's 1 MiB message limit."""
POLICY_DTYPES = ("F32", "BF16", "F16")
DELTA_FORMAT: Final = "intellect-node/delta/1"
_MAX_SIZE = 1 << 50  # a byte count that no real checkpoint reaches; bounds hostile integers


class DeltaLink(codec.Message, frozen=True):
    version: int  # the version this delta leads to (from version - 1)
    base_hash: str  # checkpoint hash of version - 1
    target_hash: str  # checkpoint hash of version
    delta_cid: str  # blob CID of the delta
    delta_size: int  # bytes of the delta blob's content


class PolicyAnnouncement(codec.Message, frozen=True):
    run_id: str
    version: int
    dtype: str  # safetensors code of the policy's floating-point weights
    checkpoint_hash: str
    checkpoint_size: int
    full_version: int
    full_cid: str  # blob CID of version full_version's checkpoint
    full_size: int
    deltas: list[DeltaLink] = []

    @property
    def full_hash(self) -> str:
        """Checkpoint hash of version ``full_version`` (the start of the chain)."""
        if self.full_version == self.version:
            return self.checkpoint_hash
        return self.link(self.full_version + 1).base_hash

    def link(self, version: int) -> DeltaLink:
        """The delta link leading to ``version``; KeyError when this announcement does not carry it."""
        if self.deltas:
            i = version - self.deltas[0].version
            if 0 <= i < len(self.deltas):
                return self.deltas[i]
        raise KeyError(version)


class TensorDelta(codec.Message, frozen=True):
    """One tensor of a delta; ``policy/delta.py`` says what each kind's ``data`` holds."""
    name: str
    kind: Literal["same", "xor", "add", "add_by_exp", "sparse", "raw"]
    dtype: str
    shape: list[int]
    count: int = 0  # sparse: how many elements changed
    frames: list[int] = []  # add_by_exp: byte length of each exponent group's zstd frame
    data: bytes = b""


class DeltaFile(codec.Message, frozen=True):
    format: Literal["intellect-node/delta/1"]
    base_hash: str
    target_hash: str
    tensors: list[TensorDelta]


def check_announcement(ann: PolicyAnnouncement) -> PolicyAnnouncement:
    """Raise ProtocolError unless the announcement is internally consistent."""
    if not 0 < len(ann.run_id) <= 128:
        raise ProtocolError("run_id must have 1 to 128 characters")
    if not 0 <= ann.version < 1 << 62:
        raise ProtocolError(f"version {ann.version} out of range")
    if ann.dtype not in POLICY_DTYPES:
        raise ProtocolError(f"dtype {ann.dtype[:16]!r} is not one of {POLICY_DTYPES}")
    for cid in (ann.checkpoint_hash, ann.full_cid):
        validate_cid(cid)
    for size in (ann.checkpoint_size, ann.full_size):
        if not 0 < size < _MAX_SIZE:
            raise ProtocolError(f"size {size} out of range")
    if not 0 <= ann.full_version <= ann.version:
        raise ProtocolError(f"full_version {ann.full_version} not in [0, {ann.version}]")
    if len(ann.deltas) > MAX_CHAIN:
        raise ProtocolError(f"{len(ann.deltas)} delta links, at most {MAX_CHAIN}")
    first = ann.version - len(ann.deltas) + 1
    prev_hash: str | None = None
    for i, link in enumerate(ann.deltas):
        if link.version != first + i or link.version < 1:
            raise ProtocolError("delta links are not consecutive versions ending at the announced one")
        validate_cid(link.base_hash)
        validate_cid(link.target_hash)
        validate_cid(link.delta_cid)
        if not 0 < link.delta_size < _MAX_SIZE:
            raise ProtocolError(f"delta size {link.delta_size} out of range")
        if prev_hash is not None and link.base_hash != prev_hash:
            raise ProtocolError(f"delta link {link.version} does not start where link {link.version - 1} "
                                "ends")
        prev_hash = link.target_hash
    if ann.deltas and ann.deltas[-1].target_hash != ann.checkpoint_hash:
        raise ProtocolError("the last delta link does not lead to the announced checkpoint hash")
    if ann.full_version < ann.version and first > ann.full_version + 1:
        raise ProtocolError(f"delta links start at {first}; the chain from full version "
                            f"{ann.full_version} needs {ann.full_version + 1}")
    return ann


def seal_announcement(key: SigningKey, ann: PolicyAnnouncement) -> bytes:
    """The signed envelope bytes the trainer publishes."""
    check_announcement(ann)
    return key.seal(POLICY_DOMAIN, ann)


def open_announcement(data: bytes, *, run_id: str, trainer: str) -> PolicyAnnouncement:
    """Decode, verify and check an announcement: signed by ``trainer``, for ``run_id``, consistent."""
    return check_announcement(open_from_trainer(
        data, POLICY_DOMAIN, PolicyAnnouncement, max_size=MAX_ANNOUNCEMENT_BYTES, run_id=run_id,
        trainer=trainer, what="policy announcement"))


def announcement_validator(run_id: str, trainer: str) -> Callable[[bytes, str], PolicyAnnouncement]:
    """A gossip validator ``(bytes, from_peer) -> PolicyAnnouncement`` for ``swarm.subscribe``."""

    def validate(data: bytes, from_peer: str) -> PolicyAnnouncement:
        return open_announcement(data, run_id=run_id, trainer=trainer)

    return validate
