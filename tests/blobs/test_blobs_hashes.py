"""Chunk hashes: new blobs name their chunks by BLAKE3, blobs of earlier versions (sha2-256 chunk CIDs)
are still fetched and checked, and bytes that do not match the CID's own function are refused."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import blake3
import pytest

from intellect_node.blobs.fetch import StaticProvider
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.protocol.blob import Manifest, seal_manifest
from intellect_node.protocol.ids import (
    BLAKE3,
    SHA2_256,
    cid_from_digest,
    cid_of,
    digest_from_cid,
    hash_code,
    validate_cid,
)
from intellect_node.protocol.signing import SigningKey
from tests.blobs.test_blobs_fetch import CHUNK, Node, _mallory_routes, _serve


def test_cid_names_its_hash_function() -> None:
    data = b"hello"
    old, new = cid_of(data), cid_of(data, BLAKE3)
    assert old.startswith("bafkrei") and new.startswith("bafkr4i") and len(old) == len(new)
    assert hash_code(old) == SHA2_256 and hash_code(new) == BLAKE3
    assert digest_from_cid(new) == blake3.blake3(data).digest()
    assert validate_cid(new) == new and cid_from_digest(digest_from_cid(new), BLAKE3) == new
    # Another multihash code in the same shape (sha2-512 truncated, 0x13) is refused, as is a
    # non-canonical spelling of a BLAKE3 CID.
    forged = "b" + base64.b32encode(b"\x01\x55\x13\x20" + bytes(32)).decode().rstrip("=").lower()
    b32 = "abcdefghijklmnopqrstuvwxyz234567"
    for bad in [forged, new[:-1] + b32[b32.index(new[-1]) ^ 1], new.upper()]:
        with pytest.raises(ProtocolError):
            hash_code(bad)


def test_chunk_writer_checks_with_the_cids_function(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = os.urandom(5000)
    for code in (SHA2_256, BLAKE3):
        w = store.open_chunk_writer(cid_of(data, code), len(data))
        w.write(data)
        w.commit()
        assert store.verify_chunk(cid_of(data, code))
    # Right bytes, but the CID of the other function with the same digest: refused.
    twisted = cid_from_digest(blake3.blake3(data).digest(), SHA2_256)
    w = store.open_chunk_writer(twisted, len(data))
    w.write(data)
    with pytest.raises(IntegrityError, match="hash"):
        w.check()
    w.abort()


def _publish_sha256(store: BlobStore, key: SigningKey, data: bytes) -> tuple[str, Manifest]:
    """What a peer of an earlier version published: sha2-256 chunk CIDs."""
    chunks = []
    for off in range(0, len(data), CHUNK):
        piece = data[off:off + CHUNK]
        cid = cid_of(piece, SHA2_256)
        atomic_write_bytes(store.chunk_path(cid), piece)
        store.mark_chunk(cid)
        chunks.append(cid)
    m = Manifest(name="old.bin", publisher=key.peer_id, chunk_size=CHUNK, total_size=len(data), chunks=chunks)
    cid, raw = seal_manifest(key, m)
    store.put_manifest(cid, raw)
    return cid, m


def test_sha256_blob_of_an_older_peer_fetched_checked_and_served(tmp_path: Path) -> None:
    """A blob with sha2-256 chunk CIDs comes through whole; a provider corrupting it is caught by the
    sha2-256 check and penalised; the fetcher then serves those chunks to the next peer."""
    data = os.urandom(12 * CHUNK + 7)

    async def main() -> None:
        old = Node(tmp_path / "old")
        cid, m = _publish_sha256(old.svc.store, old.svc.key, data)
        await old.start()
        mstore = BlobStore(tmp_path / "mallory")
        mstore.put_manifest(cid, old.svc.store.manifest_bytes(cid) or b"")
        for c in m.chunks:
            atomic_write_bytes(mstore.chunk_path(c), old.svc.store.chunk_path(c).read_bytes())
            mstore.mark_chunk(c)
        served: list[str] = []
        mallory_runner, mallory_url = await _serve(_mallory_routes(mstore, served))
        mallory = SigningKey.generate()
        f = await Node(tmp_path / "f").start()
        f.providers = [StaticProvider(mallory.peer_id, mallory_url), old.as_provider()]
        stats = await f.svc.fetch(cid, out=tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == data
        assert served and "does not match its hash" in stats.bad[mallory.peer_id]
        assert all(hash_code(c) == SHA2_256 for c in f.svc.store.manifest(cid).chunks)  # type: ignore[union-attr]  # set by now
        nxt = await Node(tmp_path / "next").start()
        nxt.providers = [f.as_provider()]
        await nxt.svc.fetch(cid, out=tmp_path / "next.bin")
        assert (tmp_path / "next.bin").read_bytes() == data
        for n in (old, f, nxt):
            await n.stop()
        await mallory_runner.cleanup()

    asyncio.run(main())
