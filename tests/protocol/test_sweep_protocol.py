"""Sweep wire messages: round trips, signatures and domains, limits, and random bytes (hypothesis)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol import sweep as W
from intellect_node.protocol.signing import Envelope, SigningKey
from intellect_node.research.sweep import grid, noise_job

KEY = SigningKey(bytes(range(32)))
OTHER = SigningKey(bytes(range(1, 33)))
NOW = int(time.time() * 1000)


def _messages() -> list[W.SweepMessage]:
    spec, nspec = grid("smoke")[0], noise_job("bernoulli", 0.1, 0)
    jid = W.job_id(spec)
    return [
        W.Offer(run_id="r", sweep_id="smoke-1", time_ms=NOW, open_jobs=40, finished=False,
                jobs=[spec, nspec]),
        W.Claim(run_id="r", sweep_id="smoke-1", time_ms=NOW, coordinator=OTHER.peer_id, job_ids=[jid],
                capacity=1),
        W.Grant(run_id="r", sweep_id="smoke-1", time_ms=NOW, worker=OTHER.peer_id,
                assignments=[W.Assignment(job=spec, deadline_ms=NOW + 60_000)]),
        W.Result(run_id="r", sweep_id="smoke-1", time_ms=NOW, coordinator=OTHER.peer_id, job_id=jid,
                 polysemantic=3, sign_hash="a" * 64, final_loss=0.25, fourth_norm=[(0, 0.1), (1000, 0.2)],
                 seconds=1.5),
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_round_trip_and_signer(msg: W.SweepMessage) -> None:
    data = W.seal(KEY, msg)
    got, signer = W.open_message(data, run_id="r", now_ms=NOW)
    assert got == msg and signer == KEY.peer_id


def test_job_id_is_the_cid_of_the_spec() -> None:
    a, b = grid("smoke")[:2]
    assert W.job_id(a) == W.job_id(msgspec.structs.replace(a)) != W.job_id(b)
    assert W.job_id(a).startswith("bafkrei")


def test_domain_swap_and_tampering_are_refused() -> None:
    claim = _messages()[1]
    data = W.seal(KEY, claim)
    env = codec.decode(data, Envelope, max_size=1 << 20)
    # A claim's signature re-labelled as a result: the signature covers the domain.
    relabelled = codec.encode(msgspec.structs.replace(env, domain=W.RESULT_DOMAIN))
    with pytest.raises(ProtocolError, match="signature"):
        W.open_message(relabelled, run_id="r", now_ms=NOW)
    tampered = codec.encode(msgspec.structs.replace(env, payload=env.payload[:-1] + b"\x02"))
    with pytest.raises(ProtocolError):
        W.open_message(tampered, run_id="r", now_ms=NOW)
    with pytest.raises(ProtocolError, match="domain"):
        W.open_message(KEY.seal("intellect/heartbeat/1", claim), run_id="r", now_ms=NOW)


@pytest.mark.parametrize("bad", [
    {"run_id": "other"}, {"sweep_id": "Bad Id"}, {"time_ms": NOW - 3_600_000},
])
def test_wrong_run_bad_id_and_stale_messages(bad: dict[str, Any]) -> None:
    msg = msgspec.structs.replace(_messages()[0], **bad)
    with pytest.raises(ProtocolError):
        W.open_message(W.seal(KEY, msg), run_id="r", now_ms=NOW)


@pytest.mark.parametrize("change", [
    {"n": 100_000}, {"n": 4096, "m": 16384}, {"steps": 10**7}, {"variant": "rm -rf"},
    {"lr": float("nan")}, {"sigma": float("inf")}, {"noise": "gaussian"}, {"seed": -1},
])
def test_offered_specs_outside_limits_are_refused(change: dict[str, Any]) -> None:
    spec = msgspec.structs.replace(grid("smoke")[0], **change)
    offer = msgspec.structs.replace(_messages()[0], jobs=[spec])
    with pytest.raises(ProtocolError):
        W.open_message(W.seal(KEY, offer), run_id="r", now_ms=NOW)


@pytest.mark.parametrize("change", [
    {"sign_hash": "zz"}, {"polysemantic": -1}, {"job_id": "not-a-cid"}, {"final_loss": float("nan")},
    {"fourth_norm": [(0, 0.1)] * (W.MAX_CURVE_POINTS + 1)}, {"coordinator": "12D3KooWnope"},
])
def test_malformed_results_are_refused(change: dict[str, Any]) -> None:
    msg = msgspec.structs.replace(_messages()[3], **change)
    with pytest.raises(ProtocolError):
        W.open_message(W.seal(KEY, msg), run_id="r", now_ms=NOW)


def test_oversize_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        W.open_message(b"\x00" * (W.MAX_MESSAGE_SIZE + 4096), run_id="r", now_ms=NOW)


def test_claim_capacity_and_list_limits() -> None:
    claim = _messages()[1]
    assert isinstance(claim, W.Claim)
    for change in ({"capacity": 0}, {"capacity": W.MAX_CAPACITY + 1},
                   {"job_ids": [claim.job_ids[0]] * (W.MAX_JOBS_PER_MESSAGE + 1)}):
        with pytest.raises(ProtocolError):
            W.open_message(W.seal(KEY, msgspec.structs.replace(claim, **change)), run_id="r", now_ms=NOW)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        W.open_message(data, run_id="r", now_ms=NOW)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=256),
       st.sampled_from([W.OFFER_DOMAIN, W.CLAIM_DOMAIN, W.GRANT_DOMAIN, W.RESULT_DOMAIN]))
def test_signed_garbage_payloads_raise_only_protocol_error(payload: bytes, domain: str) -> None:
    env = Envelope(domain=domain, payload=payload, signer=KEY.peer_id,
                   signature=KEY.sign_bytes(domain, payload))
    with pytest.raises(ProtocolError):
        W.open_message(codec.encode(env), run_id="r", now_ms=NOW)
