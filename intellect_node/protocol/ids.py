"""Peer IDs (libp2p, ed25519 identity multihash) and content IDs (CIDv1, raw, sha2-256, base32).

Both are computed here from first principles so ``protocol/`` needs no libp2p: a ``12D3KooW...`` peer
ID embeds its ed25519 public key, so a signature can be checked against the peer ID alone.
"""

from __future__ import annotations

import base64
import hashlib

import base58

from intellect_node.errors import ProtocolError

# libp2p PublicKey protobuf: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) = 32 bytes.
_ED25519_PB_PREFIX = b"\x08\x01\x12\x20"
# multihash: identity (0x00), length 36.
_IDENTITY_MH_PREFIX = b"\x00\x24"
# CIDv1 (0x01), raw codec (0x55), sha2-256 (0x12) of 32 bytes (0x20).
_CID_PREFIX = b"\x01\x55\x12\x20"
CID_STR_LEN = 59  # 'b' + base32(36 bytes) without padding


def peer_id_from_public_key(public_key: bytes) -> str:
    if len(public_key) != 32:
        raise ProtocolError("an ed25519 public key has 32 bytes")
    return base58.b58encode(_IDENTITY_MH_PREFIX + _ED25519_PB_PREFIX + public_key).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The ed25519 public key inside a ``12D3KooW...`` peer ID; ProtocolError for anything else."""
    if not isinstance(peer_id, str) or len(peer_id) != 52:
        raise ProtocolError("not an ed25519 peer ID")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as exc:
        raise ProtocolError("peer ID is not base58") from exc
    prefix = _IDENTITY_MH_PREFIX + _ED25519_PB_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise ProtocolError("not an ed25519 peer ID")
    return raw[len(prefix):]


def cid_from_digest(digest: bytes) -> str:
    if len(digest) != 32:
        raise ProtocolError("a sha2-256 digest has 32 bytes")
    return "b" + base64.b32encode(_CID_PREFIX + digest).decode("ascii").rstrip("=").lower()


def cid_of(data: bytes | bytearray | memoryview) -> str:
    """CIDv1 (raw, sha2-256) of ``data``, as the usual base32 string (``bafkrei...``)."""
    return cid_from_digest(hashlib.sha256(data).digest())


def digest_from_cid(cid: str) -> bytes:
    """The sha2-256 digest named by ``cid``; ProtocolError for anything that is not such a CID."""
    if not isinstance(cid, str) or len(cid) != CID_STR_LEN or not cid.startswith("b"):
        raise ProtocolError(f"not a CIDv1 raw sha2-256 string: {cid[:80]!r}")
    body = cid[1:].upper()
    try:
        raw = base64.b32decode(body + "=" * (-len(body) % 8))
    except ValueError as exc:
        raise ProtocolError("CID is not base32") from exc
    if not raw.startswith(_CID_PREFIX) or len(raw) != 36:
        raise ProtocolError("CID is not CIDv1 raw sha2-256")
    if cid_from_digest(raw[4:]) != cid:
        raise ProtocolError("CID is not canonically encoded")
    return raw[4:]


def validate_cid(cid: str) -> str:
    digest_from_cid(cid)
    return cid
