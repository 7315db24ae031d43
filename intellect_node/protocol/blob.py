"""Content-addressed blobs: the signed manifest and the "have" bitmap (wire formats only).

A blob (a checkpoint file, a rollout batch) is cut into fixed-size chunks. Each chunk is named by its
CID (CIDv1, raw, sha2-256, see :mod:`intellect_node.protocol.ids`). A :class:`Manifest` lists the chunk
CIDs in order, the chunk size, the total size, a name and the publisher's peer ID; it travels as a
signed :class:`~intellect_node.protocol.signing.Envelope` and the blob's ID is the CID of those
envelope bytes. So the ID pins the publisher, the name and every byte of content.

Shortcuts, on purpose:
- Chunk sizes are not listed: every chunk but the last has ``chunk_size`` bytes and the last holds the
  remainder, so they follow from ``total_size``; that leaves nothing inconsistent for a peer to lie about.
- The "have" bitmap a provider serves is unsigned. It is a hint about which chunks to ask that provider
  for; a wrong hint costs a 404 and a retry elsewhere, never wrong bytes (every chunk is hash-checked).
"""

from __future__ import annotations

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import CID_STR_LEN, cid_of, public_key_from_peer_id, validate_cid
from intellect_node.protocol.signing import ENVELOPE_OVERHEAD, SigningKey, open_envelope

MANIFEST_DOMAIN = "intellect/blob-manifest/1"
"""Signature domain of manifests (a manifest signature cannot be replayed as another message kind)."""

HTTP_PREFIX = "/blob/v1"
"""Versioned path prefix of the bulk HTTP routes: ``/manifest/<cid>``, ``/chunk/<cid>``, ``/have/<cid>``."""

DEFAULT_CHUNK_SIZE = 3 * 1024 * 1024
"""3 MiB, chosen by measurement (bench/README.md, "broadcast", "Chunk size"): a peer serves a chunk only
once it holds and has checked all of it, so smaller chunks spread faster where links are the limit
(256 MiB to 8 peers at 100 Mbit/s: 1.25-1.31x the one-copy bound at 3 MiB, 1.30-1.38x at 4), and each
chunk costs a request, a file and a bitmap update where CPU is (on loopback 3 MiB matched 4 MiB once
file creation was measured apart from the development machine's recent deletions)."""

MIN_CHUNK_SIZE = 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
"""A receiver allocates and buffers at most this much per chunk request."""

MAX_CHUNKS = 16384
"""16384 chunks: 48 GiB at the default chunk size, 1 TiB at the largest; bounds the manifest size."""

MAX_NAME_LEN = 255

MAX_MANIFEST_SIZE = 64 + MAX_NAME_LEN * 4 + 64 + MAX_CHUNKS * (CID_STR_LEN + 2)
"""Upper bound of an encoded manifest (about 1 MiB); checked before decoding."""

MAX_MANIFEST_ENVELOPE_SIZE = MAX_MANIFEST_SIZE + ENVELOPE_OVERHEAD
MAX_HAVE_SIZE = 128 + CID_STR_LEN + MAX_CHUNKS // 8


class Manifest(codec.Message, frozen=True):
    """What a blob is made of. Chunk ``i`` covers bytes ``[i*chunk_size, min((i+1)*chunk_size, total))``."""

    name: str
    publisher: str  # peer ID of the signer; must match the envelope's signer
    chunk_size: int
    total_size: int
    chunks: list[str]

    def chunk_length(self, index: int) -> int:
        """Byte length of chunk ``index``."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(index)
        return min(self.chunk_size, self.total_size - index * self.chunk_size)

    def chunk_lengths(self) -> list[int]:
        return [self.chunk_length(i) for i in range(len(self.chunks))]


class Have(codec.Message, frozen=True):
    """Which chunks of a manifest a provider holds: bit ``i`` (LSB first within each byte) is chunk ``i``."""

    manifest: str
    count: int  # number of chunks in the manifest
    bitmap: bytes

    def has(self, index: int) -> bool:
        return bool(self.bitmap[index >> 3] & (1 << (index & 7)))

    def held(self) -> int:
        return sum(bin(b).count("1") for b in self.bitmap)


def expected_chunk_count(total_size: int, chunk_size: int) -> int:
    return -(-total_size // chunk_size)


def validate_manifest(m: Manifest) -> Manifest:
    """Raise ProtocolError unless ``m`` is internally consistent and within the size limits."""
    if not m.name or len(m.name) > MAX_NAME_LEN or any(c in m.name for c in "\x00/\\"):
        raise ProtocolError(f"manifest name must be 1..{MAX_NAME_LEN} characters without '/', '\\\\' or NUL")
    public_key_from_peer_id(m.publisher)
    if not MIN_CHUNK_SIZE <= m.chunk_size <= MAX_CHUNK_SIZE:
        raise ProtocolError(f"chunk_size {m.chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    if m.total_size < 0:
        raise ProtocolError("negative total_size")
    if len(m.chunks) > MAX_CHUNKS:
        raise ProtocolError(f"{len(m.chunks)} chunks exceed the limit of {MAX_CHUNKS}")
    if len(m.chunks) != expected_chunk_count(m.total_size, m.chunk_size):
        raise ProtocolError(f"{len(m.chunks)} chunks do not cover {m.total_size} bytes in "
                            f"chunks of {m.chunk_size}")
    for c in m.chunks:
        validate_cid(c)
    return m


def seal_manifest(key: SigningKey, manifest: Manifest) -> tuple[str, bytes]:
    """Sign ``manifest`` with ``key``; return ``(blob_cid, envelope_bytes)``."""
    if manifest.publisher != key.peer_id:
        raise ValueError("the manifest's publisher must be the signing key's peer ID")
    validate_manifest(manifest)
    raw = key.seal(MANIFEST_DOMAIN, manifest)
    return cid_of(raw), raw


def open_manifest(raw: bytes, expected_cid: str | None = None) -> Manifest:
    """Strictly decode and verify manifest envelope bytes; ProtocolError for anything wrong.

    With ``expected_cid`` the bytes must also be the ones that CID names (checked first: cheapest).
    """
    if len(raw) > MAX_MANIFEST_ENVELOPE_SIZE:
        raise ProtocolError(f"manifest of {len(raw)} bytes exceeds {MAX_MANIFEST_ENVELOPE_SIZE}")
    if expected_cid is not None and cid_of(raw) != expected_cid:
        raise ProtocolError("manifest bytes do not match the requested CID")
    m, signer = open_envelope(raw, MANIFEST_DOMAIN, Manifest, max_size=MAX_MANIFEST_SIZE)
    if m.publisher != signer:
        raise ProtocolError("manifest publisher is not its signer")
    return validate_manifest(m)


def encode_have(manifest_cid: str, present: list[bool]) -> bytes:
    bitmap = bytearray((len(present) + 7) // 8)
    for i, p in enumerate(present):
        if p:
            bitmap[i >> 3] |= 1 << (i & 7)
    return codec.encode(Have(manifest=manifest_cid, count=len(present), bitmap=bytes(bitmap)))


def decode_have(raw: bytes, manifest_cid: str, count: int) -> Have:
    """Decode a provider's bitmap for ``manifest_cid`` with ``count`` chunks; ProtocolError if it is off."""
    h = codec.decode(raw, Have, max_size=MAX_HAVE_SIZE)
    if h.manifest != manifest_cid:
        raise ProtocolError("have bitmap for another manifest")
    if h.count != count or len(h.bitmap) != (count + 7) // 8:
        raise ProtocolError("have bitmap has the wrong length")
    if count % 8 and h.bitmap[-1] >> (count % 8):
        raise ProtocolError("have bitmap sets bits past the last chunk")
    return h
