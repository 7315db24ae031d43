"""Run manifests and run listings: round trips, the organiser's signature (honest vs mallory), forged
fields, size limits before decoding, unknown fields, and random bytes raising only ProtocolError."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.blob import Manifest
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.run_manifest import (
    MAX_RUN_ENVELOPE_BYTES,
    RUN_DOMAIN,
    ModelFile,
    RunListing,
    RunManifest,
    RunSeen,
    canonical_json,
    check_model_blob,
    check_run_blob,
    open_listing,
    open_run_manifest,
    seal_listing,
    seal_run_manifest,
)
from intellect_node.protocol.signing import Envelope, SigningKey

ORGANISER, MALLORY = SigningKey.generate(), SigningKey.generate()
BLOB = cid_of(b"config.json")


def _manifest(**kw: Any) -> RunManifest:
    base: dict[str, Any] = dict(
        format="intellect-node/run/1", run_id="r1", organiser=ORGANISER.peer_id, created_ms=1_700_000_000_000,
        model_name="qwen3-tiny", model_files=[ModelFile(path="config.json", blob=BLOB, size=700),
                                             ModelFile(path="model.safetensors", blob=cid_of(b"w"), size=9)],
        config=canonical_json({"run": {"run_id": "r1"}, "rl": {"env": "reasoning_gym:chain_sum"}}),
        thresholds='{"x": {}}',
        bootstrap=[f"/ip4/127.0.0.1/tcp/4101/p2p/{ORGANISER.peer_id}"])
    base.update(kw)
    return RunManifest(**base)


def _forge(raw: bytes, **changes: object) -> bytes:
    """The envelope ``raw`` with its payload's fields changed and the organiser's signature kept."""
    env = codec.decode(raw, Envelope, max_size=1 << 20)
    m = codec.decode(env.payload, RunManifest, max_size=1 << 20)
    forged = msgspec.structs.replace(m, **changes)
    return codec.encode(msgspec.structs.replace(env, payload=codec.encode(forged)))


def test_round_trip_and_what_the_cid_pins() -> None:
    m = _manifest()
    raw = seal_run_manifest(ORGANISER, m)
    assert open_run_manifest(raw) == m
    assert open_run_manifest(raw, organiser=ORGANISER.peer_id) == m
    assert m.env == "reasoning_gym:chain_sum" and m.model_bytes == 709
    # Sealing is deterministic (ed25519), and any changed field gives other bytes, hence another CID.
    assert seal_run_manifest(ORGANISER, m) == raw
    change: dict[str, Any]
    for change in ({"created_ms": m.created_ms + 1}, {"thresholds": '{"y": {}}'},
                   {"bootstrap": []}, {"model_name": "other"}):
        assert cid_of(seal_run_manifest(ORGANISER, msgspec.structs.replace(m, **change))) != cid_of(raw)


def test_bad_signature_forged_field_and_wrong_organiser_are_refused() -> None:
    raw = seal_run_manifest(ORGANISER, _manifest())
    env = codec.decode(raw, Envelope, max_size=1 << 20)
    bad_sig = codec.encode(msgspec.structs.replace(env, signature=bytes(64)))
    with pytest.raises(ProtocolError, match="bad signature"):
        open_run_manifest(bad_sig)
    # A forged field under the organiser's signature: the signature no longer covers the payload.
    with pytest.raises(ProtocolError, match="bad signature"):
        open_run_manifest(_forge(raw, config=canonical_json({"run": {"run_id": "r1"}, "rl": {"lr": 1.0}})))
    # Mallory signs a manifest naming the organiser; or signs its own and is not the organiser asked for.
    forged = codec.encode(Envelope(domain=RUN_DOMAIN, payload=env.payload, signer=MALLORY.peer_id,
                                   signature=MALLORY.sign_bytes(RUN_DOMAIN, env.payload)))
    with pytest.raises(ProtocolError, match="not its signer"):
        open_run_manifest(forged)
    own = seal_run_manifest(MALLORY, _manifest(organiser=MALLORY.peer_id))
    with pytest.raises(ProtocolError, match="not by the organiser"):
        open_run_manifest(own, organiser=ORGANISER.peer_id)
    # A signature made for another kind of message is not a manifest signature.
    other = codec.encode(Envelope(domain="intellect/policy/1", payload=env.payload, signer=ORGANISER.peer_id,
                                  signature=ORGANISER.sign_bytes("intellect/policy/1", env.payload)))
    with pytest.raises(ProtocolError, match="expected"):
        open_run_manifest(other)


def test_oversize_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        open_run_manifest(b"\x00" * (MAX_RUN_ENVELOPE_BYTES + 1))
    with pytest.raises(ProtocolError, match="size limit"):
        seal_run_manifest(ORGANISER, _manifest(thresholds='{"a": "' + "x" * 300_000 + '"}'))


def test_unknown_fields_are_refused() -> None:
    class Extended(RunManifest, frozen=True):
        note: str = ""

    m = _manifest()
    payload = codec.encode(Extended(**{f: getattr(m, f) for f in m.__struct_fields__}, note="hi"))
    raw = codec.encode(Envelope(domain=RUN_DOMAIN, payload=payload, signer=ORGANISER.peer_id,
                                signature=ORGANISER.sign_bytes(RUN_DOMAIN, payload)))
    with pytest.raises(ProtocolError, match="note"):
        open_run_manifest(raw)
    # and in the configuration: only the shared sections, as canonical JSON
    for config, why in ((canonical_json({"run": {}, "network": {}}), "only the sections"),
                        ('{"rl": {}, "run": {}}', "not canonical"), ("[1]", "only the sections")):
        sealed = seal_with_checks_skipped(_manifest(config=config))
        with pytest.raises(ProtocolError, match=why):
            open_run_manifest(sealed)


def seal_with_checks_skipped(m: RunManifest) -> bytes:
    """What a hostile organiser can send: any payload, signed."""
    payload = codec.encode(m)
    return codec.encode(Envelope(domain=RUN_DOMAIN, payload=payload, signer=m.organiser,
                                 signature=ORGANISER.sign_bytes(RUN_DOMAIN, payload)))


@pytest.mark.parametrize("change, why", [
    ({"run_id": "Bad Run"}, "bad run id"),
    ({"model_files": [ModelFile(path="../etc/passwd", blob=BLOB, size=1)]}, "plain file name"),
    ({"model_files": [ModelFile(path="model.safetensors", blob=BLOB, size=1)]}, "lack config.json"),
    ({"model_files": [ModelFile(path="config.json", blob="nope", size=1)]}, "CID"),
    ({"model_files": [ModelFile(path="config.json", blob=BLOB, size=-1)]}, "out of range"),
    ({"model_files": []}, "model files"),
    ({"config": canonical_json({"run": {"run_id": "r2"}})}, "run_id differs"),
    ({"thresholds": "not json"}, "thresholds are not JSON"),
    ({"bootstrap": ["/ip4/1.2.3.4/tcp/1"]}, "/p2p/"),
    ({"created_ms": 0}, "created_ms"),
])
def test_each_bound_is_checked(change: dict[str, object], why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        open_run_manifest(seal_with_checks_skipped(_manifest(**change)))


def test_blobs_of_the_run_must_be_the_organisers() -> None:
    m = _manifest()
    ok = Manifest(name="run", publisher=ORGANISER.peer_id, chunk_size=1024, total_size=700, chunks=[BLOB])
    check_run_blob(ok, m)
    check_model_blob(ok, m, m.model_files[0])
    theirs = msgspec.structs.replace(ok, publisher=MALLORY.peer_id)
    with pytest.raises(ProtocolError, match="not by the run's organiser"):
        check_model_blob(theirs, m, m.model_files[0])
    with pytest.raises(ProtocolError, match="not by its organiser"):
        check_run_blob(theirs, m)
    with pytest.raises(ProtocolError, match="holds 9 bytes"):
        check_model_blob(msgspec.structs.replace(ok, total_size=9), m, m.model_files[0])


def test_listing_signer_and_clock() -> None:
    listing = RunListing(node=ORGANISER.peer_id, time_ms=1_700_000_000_000,
                         runs=[RunSeen(cid=BLOB, run_id="r1", nodes={"trainer": 1, "worker": 3},
                                       policy_version=4, step=4)])
    raw = seal_listing(ORGANISER, listing)
    assert open_listing(raw, now_ms=listing.time_ms, signer=ORGANISER.peer_id) == listing
    with pytest.raises(ProtocolError, match="not signed by the node"):
        open_listing(raw, now_ms=listing.time_ms, signer=MALLORY.peer_id)
    with pytest.raises(ProtocolError, match="clock"):
        open_listing(raw, now_ms=listing.time_ms + 11 * 60_000)
    lying = codec.encode(Envelope(domain="intellect/run-listing/1", payload=codec.encode(listing),
                                  signer=MALLORY.peer_id,
                                  signature=MALLORY.sign_bytes("intellect/run-listing/1",
                                                               codec.encode(listing))))
    with pytest.raises(ProtocolError, match="not signed by the node"):
        open_listing(lying, now_ms=listing.time_ms)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    for opener in (lambda: open_run_manifest(data), lambda: open_listing(data, now_ms=0)):
        try:
            opener()
        except ProtocolError:
            pass


def test_a_listings_held_out_figures_are_bounded_and_name_a_real_evaluator() -> None:
    from intellect_node.protocol.run_manifest import HeldOutSeen

    def listing(held: HeldOutSeen) -> RunListing:
        return RunListing(node=ORGANISER.peer_id, time_ms=1_700_000_000_000,
                          runs=[RunSeen(cid=BLOB, run_id="r1", nodes={"validator": 1}, held_out=held)])

    good = HeldOutSeen(version=10, n=128, pass_rate=0.25, mean_reward=0.4, evaluator=MALLORY.peer_id)
    raw = seal_listing(ORGANISER, listing(good))
    assert open_listing(raw, now_ms=1_700_000_000_000).runs[0].held_out == good
    for bad in (msgspec.structs.replace(good, pass_rate=1.5), msgspec.structs.replace(good, n=0),
                msgspec.structs.replace(good, mean_reward=float("nan")),
                msgspec.structs.replace(good, version=-1)):
        with pytest.raises(ProtocolError, match="held-out figures"):
            seal_listing(ORGANISER, listing(bad))
    with pytest.raises(ProtocolError):
        seal_listing(ORGANISER, listing(msgspec.structs.replace(good, evaluator="not-a-peer")))
