"""Blob manifest and have-bitmap codecs: round trips, signatures, limits; hostile bytes raise only
ProtocolError."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.blobs.store import BlobStore
from intellect_node.errors import ConfigError, IntegrityError, ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.blob import (
    MANIFEST_DOMAIN,
    MAX_CHUNKS,
    Have,
    Manifest,
    decode_have,
    encode_have,
    open_manifest,
    seal_manifest,
)
from intellect_node.protocol.ids import BLAKE3, cid_of
from intellect_node.protocol.signing import Envelope, SigningKey

ALICE = SigningKey(bytes(range(32)))
MALLORY = SigningKey(bytes(range(1, 33)))


def _manifest(total: int, chunk_size: int, name: str = "ckpt.safetensors",
              key: SigningKey = ALICE) -> Manifest:
    n = -(-total // chunk_size)
    chunks = [cid_of(i.to_bytes(4, "big")) for i in range(n)]
    return Manifest(name=name, publisher=key.peer_id, chunk_size=chunk_size, total_size=total, chunks=chunks)


@given(st.integers(0, 200_000), st.integers(1024, 70_000),
       st.text(min_size=1, max_size=40).filter(lambda s: not any(c in s for c in "\x00/\\")))
@settings(max_examples=60, deadline=None)
def test_manifest_round_trip(total: int, chunk_size: int, name: str) -> None:
    m = _manifest(total, chunk_size, name)
    cid, raw = seal_manifest(ALICE, m)
    assert cid == cid_of(raw)
    got = open_manifest(raw, cid)
    assert got == m
    assert sum(got.chunk_lengths()) == total
    assert all(0 < n <= chunk_size for n in got.chunk_lengths())


@given(st.binary(max_size=400))
@settings(max_examples=300)
def test_random_bytes_raise_only_protocol_error(raw: bytes) -> None:
    for expected in (None, cid_of(raw)):
        with pytest.raises(ProtocolError):
            open_manifest(raw, expected)
    try:
        decode_have(raw, cid_of(b"x"), 10)
    except ProtocolError:
        pass


@given(st.binary(min_size=1, max_size=64), st.integers(0, 10_000))
@settings(max_examples=200)
def test_mutated_manifest_raises_only_protocol_error(junk: bytes, pos: int) -> None:
    _, raw = seal_manifest(ALICE, _manifest(50_000, 4096))
    pos %= len(raw)
    mutated = raw[:pos] + junk + raw[pos + len(junk):]
    if mutated == raw:
        return
    with pytest.raises(ProtocolError):
        open_manifest(mutated)


def test_manifest_signature_identity_and_consistency() -> None:
    m = _manifest(10_000, 4096)
    cid, raw = seal_manifest(ALICE, m)
    with pytest.raises(ProtocolError, match="CID"):
        open_manifest(raw, cid_of(b"other"))
    # Mallory re-signs Alice's manifest: the signature is valid but the publisher field is Alice's.
    forged = MALLORY.seal(MANIFEST_DOMAIN, m)
    with pytest.raises(ProtocolError, match="publisher"):
        open_manifest(forged)
    # Mallory claims Alice as signer.
    env = codec.decode(raw, Envelope, max_size=1 << 20)
    claimed = Envelope(domain=env.domain, payload=env.payload, signer=ALICE.peer_id,
                       signature=MALLORY.sign_bytes(env.domain, env.payload))
    with pytest.raises(ProtocolError, match="signature"):
        open_manifest(codec.encode(claimed))
    # Signed, but the chunk list does not cover the total size.
    short = Manifest(name="x", publisher=ALICE.peer_id, chunk_size=4096, total_size=10_000,
                     chunks=m.chunks[:2])
    with pytest.raises(ProtocolError, match="cover"):
        open_manifest(ALICE.seal(MANIFEST_DOMAIN, short))
    for bad in (Manifest(name="a/b", publisher=ALICE.peer_id, chunk_size=4096, total_size=0, chunks=[]),
                Manifest(name="x", publisher=ALICE.peer_id, chunk_size=10, total_size=0, chunks=[]),
                Manifest(name="x", publisher=ALICE.peer_id, chunk_size=4096, total_size=1,
                         chunks=["bafkreinotacid"])):
        with pytest.raises(ProtocolError):
            open_manifest(ALICE.seal(MANIFEST_DOMAIN, bad))
    with pytest.raises(ValueError):
        seal_manifest(MALLORY, m)


def test_oversize_manifest_refused_before_decoding() -> None:
    huge = _manifest((MAX_CHUNKS + 1) * 1024, 1024)
    with pytest.raises(ProtocolError):
        open_manifest(ALICE.seal(MANIFEST_DOMAIN, huge))
    with pytest.raises(ProtocolError, match="exceeds"):
        open_manifest(b"\x00" * (2 << 20))


@given(st.lists(st.booleans(), max_size=300))
def test_have_round_trip(bits: list[bool]) -> None:
    mcid = cid_of(b"m")
    h = decode_have(encode_have(mcid, bits), mcid, len(bits))
    assert [h.has(i) for i in range(len(bits))] == bits
    assert h.held() == sum(bits)


def test_have_rejects_wrong_shape() -> None:
    mcid = cid_of(b"m")
    raw = encode_have(mcid, [True] * 10)
    with pytest.raises(ProtocolError):
        decode_have(raw, cid_of(b"n"), 10)
    with pytest.raises(ProtocolError):
        decode_have(raw, mcid, 11)
    stray = codec.encode(Have(manifest=mcid, count=10, bitmap=b"\xff\xff"))  # bits 10..15 set
    with pytest.raises(ProtocolError, match="past"):
        decode_have(stray, mcid, 10)


def test_store_add_export_and_reload(tmp_path: Path) -> None:
    src = tmp_path / "f.bin"
    data = os.urandom(8192) + b"\x00" * 8192 + b"tail"  # chunks 2 and 3 are identical
    src.write_bytes(data)
    store = BlobStore(tmp_path / "s")
    cid, m = store.add_file(src, ALICE, chunk_size=4096)
    assert m.chunks == [cid_of(data[i:i + 4096], BLAKE3) for i in range(0, len(data), 4096)]
    assert m.chunks[2] == m.chunks[3] and m.chunk_lengths() == [4096] * 4 + [4]
    assert store.is_complete(cid)
    store.export(cid, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data
    # A fresh store over the same directory finds everything again; leftovers of a crash are removed.
    (tmp_path / "s" / "tmp" / "junk.part").write_bytes(b"partial")
    again = BlobStore(tmp_path / "s")
    assert again.is_complete(cid) and not list((tmp_path / "s" / "tmp").iterdir())
    # A chunk damaged on disk is noticed by verify_chunk and dropped.
    victim = m.chunks[0]
    again.chunk_path(victim).write_bytes(b"rot")
    assert not again.verify_chunk(victim) and not again.is_complete(cid)
    with pytest.raises(IntegrityError):
        again.export(cid, tmp_path / "out2.bin")
    with pytest.raises(ConfigError):
        store.add_file(tmp_path / "missing.bin", ALICE)


def test_chunk_writer_refuses_extra_and_wrong_bytes(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    good = b"a" * 5000
    cid = cid_of(good)
    w = store.open_chunk_writer(cid, len(good))
    with pytest.raises(IntegrityError, match="longer"):
        w.write(good + b"!")
    w.abort()
    w = store.open_chunk_writer(cid, len(good))
    w.write(b"b" * 5000)
    with pytest.raises(IntegrityError, match="hash"):
        w.check()
    w.abort()
    w = store.open_chunk_writer(cid, len(good))
    w.write(good[:100])
    w.write(good[100:])
    w.commit()
    assert store.has_chunk(cid)
    assert store.chunk_path(cid).read_bytes() == good and not list(store.tmp_dir.iterdir())


def test_unclean_store_rechecks_unflushed_chunks(tmp_path: Path) -> None:
    """Chunks committed after the last flush are re-hashed when the store opens after a crash; a store
    closed cleanly is trusted as it is."""
    store = BlobStore(tmp_path)
    flushed, late = b"f" * 3000, b"l" * 3000
    for data in (flushed, late):
        w = store.open_chunk_writer(cid_of(data), len(data))
        w.write(data)
        w.commit()
        if data is flushed:
            store.flush()
            os.utime(store.chunk_path(cid_of(data)), (1, 1))  # clearly older than the flush
    # "Power loss": the late chunk's file came back torn, and the process never closed the store.
    store.chunk_path(cid_of(late)).write_bytes(b"l" * 100)
    reopened = BlobStore(tmp_path)
    assert reopened.has_chunk(cid_of(flushed)) and not reopened.has_chunk(cid_of(late))
    reopened.close()
    assert not (tmp_path / "dirty").exists()
    assert BlobStore(tmp_path).has_chunk(cid_of(flushed))
