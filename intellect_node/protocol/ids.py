"""Peer IDs (libp2p, ed25519 identity multihash) and content IDs (CIDv1, raw, base32).

Both are computed here from first principles so ``protocol/`` needs no libp2p: a ``12D3KooW...`` peer
ID embeds its ed25519 public key, so a signature can be checked against the peer ID alone.

A CID names its hash function in its multihash code, so a reader checks bytes with the function the
writer chose. Two are accepted: sha2-256 (0x12, ``bafkrei...``; every CID this project made before
blob chunks moved to BLAKE3, and still every CID but chunks') and BLAKE3 with a 32-byte digest (0x1e,
``bafkr4i...``; blob chunks, where hashing is a large part of a peer's CPU per received byte: measured
in bench/README.md, "broadcast").
"""

from __future__ import annotations

import base64
import functools
import hashlib

import base58
import blake3

from intellect_node.errors import ProtocolError

# libp2p PublicKey protobuf: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) = 32 bytes.
_ED25519_PB_PREFIX = b"\x08\x01\x12\x20"
# multihash: identity (0x00), length 36.
_IDENTITY_MH_PREFIX = b"\x00\x24"
SHA2_256 = 0x12
BLAKE3 = 0x1e
"""Multihash codes of the hash functions a CID may name (both single-byte varints, 32-byte digests)."""
# CIDv1 (0x01), raw codec (0x55), <multihash code>, digest of 32 bytes (0x20).
_CID_PREFIXES = {code: bytes([0x01, 0x55, code, 0x20]) for code in (SHA2_256, BLAKE3)}
CID_STR_LEN = 59  # 'b' + base32(36 bytes) without padding


def peer_id_from_public_key(public_key: bytes) -> str:
    if len(public_key) != 32:
        raise ProtocolError("an ed25519 public key has 32 bytes")
    return base58.b58encode(_IDENTITY_MH_PREFIX + _ED25519_PB_PREFIX + public_key).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The ed25519 public key inside a ``12D3KooW...`` peer ID; ProtocolError for anything else."""
    if not isinstance(peer_id, str) or len(peer_id) != 52:
        raise ProtocolError("not an ed25519 peer ID")
    return _public_key(peer_id)


@functools.lru_cache(maxsize=4096)
def _public_key(peer_id: str) -> bytes:
    """Decoded once per peer (every signed record and message names its signer; base58 decoding is
    ~35 us). Refusals raise, and an exception is never cached."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as exc:
        raise ProtocolError("peer ID is not base58") from exc
    prefix = _IDENTITY_MH_PREFIX + _ED25519_PB_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise ProtocolError("not an ed25519 peer ID")
    return raw[len(prefix):]


def cid_from_digest(digest: bytes, code: int = SHA2_256) -> str:
    """The CID of a 32-byte ``digest`` made by the hash function with multihash ``code``."""
    if len(digest) != 32:
        raise ProtocolError("a CID digest has 32 bytes")
    return "b" + base64.b32encode(_CID_PREFIXES[code] + digest).decode("ascii").rstrip("=").lower()


def new_hasher(code: int) -> "hashlib._Hash | blake3.blake3":
    """A fresh incremental hasher (``update``/``digest``) for multihash ``code``."""
    if code == BLAKE3:
        return blake3.blake3()
    if code == SHA2_256:
        return hashlib.sha256()
    raise ProtocolError(f"unsupported multihash code {code:#x}")


def cid_of(data: bytes | bytearray | memoryview, code: int = SHA2_256) -> str:
    """CIDv1 (raw) of ``data`` as the usual base32 string: sha2-256 (``bafkrei...``) unless ``code``
    names BLAKE3 (``bafkr4i...``)."""
    h = new_hasher(code)
    h.update(data)
    return cid_from_digest(h.digest(), code)


def _decode_cid(cid: str) -> tuple[int, bytes]:
    if not isinstance(cid, str) or len(cid) != CID_STR_LEN or not cid.startswith("b"):
        shown = cid[:80] if isinstance(cid, str) else type(cid).__name__
        raise ProtocolError(f"not a CIDv1 raw sha2-256 or blake3 string: {shown!r}")
    return _decode_cid_str(cid)


@functools.lru_cache(maxsize=8192)
def _decode_cid_str(cid: str) -> tuple[int, bytes]:
    """Cached: a blob transfer checks the same chunk CIDs at every hop (request, store path, commit), and
    base32 is pure Python here (about a tenth of a peer's Python time in a loopback broadcast). Only
    valid CIDs are kept (a raise is not cached); the cache is bounded, so a peer naming endless new CIDs
    only evicts."""
    body = cid[1:].upper()
    try:
        raw = base64.b32decode(body + "=" * (-len(body) % 8))
    except ValueError as exc:
        raise ProtocolError("CID is not base32") from exc
    code = raw[2] if len(raw) == 36 else -1
    if _CID_PREFIXES.get(code) != raw[:4]:
        raise ProtocolError("CID is not CIDv1 raw sha2-256 or blake3")
    if cid_from_digest(raw[4:], code) != cid:
        raise ProtocolError("CID is not canonically encoded")
    return code, raw[4:]


def digest_from_cid(cid: str) -> bytes:
    """The digest named by ``cid`` (sha2-256 or BLAKE3: :func:`hash_code` says which); ProtocolError
    for anything that is not such a CID."""
    return _decode_cid(cid)[1]


def hash_code(cid: str) -> int:
    """The multihash code of the function that made ``cid`` (:data:`SHA2_256` or :data:`BLAKE3`)."""
    return _decode_cid(cid)[0]


def validate_cid(cid: str) -> str:
    digest_from_cid(cid)
    return cid
