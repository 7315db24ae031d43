"""The canonical codec, IDs and signed envelopes: round trips, and hostile bytes raise only ProtocolError."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import (
    cid_of,
    digest_from_cid,
    peer_id_from_public_key,
    public_key_from_peer_id,
)
from intellect_node.protocol.signing import Envelope, SigningKey, open_envelope


class Sample(codec.Message, frozen=True):
    name: str
    n: int
    data: bytes
    tags: dict[str, int] = {}


@given(st.text(max_size=50), st.integers(-2**63, 2**63 - 1), st.binary(max_size=200),
       st.dictionaries(st.text(max_size=10), st.integers(0, 1000), max_size=5))
def test_round_trip(name: str, n: int, data: bytes, tags: dict[str, int]) -> None:
    msg = Sample(name=name, n=n, data=data, tags=tags)
    raw = codec.encode(msg)
    assert codec.decode(raw, Sample, max_size=10_000) == msg


@given(st.binary(max_size=300))
@settings(max_examples=300)
def test_random_bytes_raise_only_protocol_error(raw: bytes) -> None:
    for t in (Sample, Envelope):
        try:
            codec.decode(raw, t, max_size=10_000)
        except ProtocolError:
            pass


def test_size_limit_checked_first() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.decode(b"\x00" * 101, Sample, max_size=100)


def test_non_canonical_refused() -> None:
    raw = msgspec.msgpack.encode({"n": 1, "name": "a", "data": b"", "tags": {}})  # field order differs
    with pytest.raises(ProtocolError, match="canonical"):
        codec.decode(raw, Sample, max_size=1000)


def test_unknown_field_refused() -> None:
    raw = msgspec.msgpack.encode({"name": "a", "n": 1, "data": b"", "tags": {}, "extra": 1})
    with pytest.raises(ProtocolError):
        codec.decode(raw, Sample, max_size=1000)


def test_peer_id_and_cid() -> None:
    key = SigningKey(bytes(range(32)))
    assert key.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(key.peer_id) == key.public_key
    assert peer_id_from_public_key(key.public_key) == key.peer_id
    cid = cid_of(b"hello")
    assert cid.startswith("bafkrei")
    assert digest_from_cid(cid) == hashlib.sha256(b"hello").digest()
    # The last base32 character carries 3 digest bits and 2 padding bits: flipping a padding bit is a
    # non-canonical spelling of the same digest and must be refused too.
    b32 = "abcdefghijklmnopqrstuvwxyz234567"
    pad_flipped = cid[:-1] + b32[b32.index(cid[-1]) ^ 1]
    for bad in ["", "bafk", pad_flipped, "Q" * 46, cid.upper(), "bafy" + cid[4:]]:
        with pytest.raises(ProtocolError):
            digest_from_cid(bad)


def test_envelope_honest_tampered_and_mallory() -> None:
    alice = SigningKey.generate()
    mallory = SigningKey.generate()
    msg = Sample(name="x", n=3, data=b"abc")
    raw = alice.seal("test/1", msg)
    got, signer = open_envelope(raw, "test/1", Sample, max_size=1000)
    assert got == msg and signer == alice.peer_id
    env = codec.decode(raw, Envelope, max_size=2000)
    # Tampered payload.
    forged = Envelope(domain=env.domain, payload=codec.encode(Sample(name="x", n=4, data=b"abc")),
                      signer=env.signer, signature=env.signature)
    with pytest.raises(ProtocolError, match="signature"):
        open_envelope(codec.encode(forged), "test/1", Sample, max_size=1000)
    # Mallory claims Alice's identity with her own signature.
    claimed = Envelope(domain=env.domain, payload=env.payload, signer=alice.peer_id,
                       signature=mallory.sign_bytes("test/1", env.payload))
    with pytest.raises(ProtocolError, match="signature"):
        open_envelope(codec.encode(claimed), "test/1", Sample, max_size=1000)
    # Replay under another domain.
    with pytest.raises(ProtocolError):
        open_envelope(raw, "test/2", Sample, max_size=1000)
