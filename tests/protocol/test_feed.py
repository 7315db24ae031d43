"""The run feed a node serves for ``run report --run`` (``protocol/feed.py``): signed by the node it
names, of one run, bounded before decoding; its lines read as JSON objects or left out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.feed import (
    FEED_DOMAIN,
    MAX_FEED_BYTES,
    MAX_FEED_LINES,
    MAX_LINE_BYTES,
    RunFeed,
    objects,
    open_feed,
    seal_feed,
)
from intellect_node.protocol.signing import Envelope, SigningKey

NODE, MALLORY = SigningKey(bytes(range(32))), SigningKey(bytes(range(1, 33)))
NOW = 1_700_000_000_000


def _feed(**over: object) -> RunFeed:
    fields: dict[str, object] = {"node": NODE.peer_id, "time_ms": NOW, "run_id": "r1",
                                 "metrics": ['{"step":0,"pass_rate":0.5}', '{"torn'],
                                 "held_out": ['{"version":0,"pass_rate":0.25}']}
    fields.update(over)
    return RunFeed(**fields)  # type: ignore[arg-type]


def test_a_feed_opens_for_its_signer_and_run_only() -> None:
    raw = seal_feed(NODE, _feed())
    feed = open_feed(raw, now_ms=NOW, signer=NODE.peer_id, run_id="r1")
    assert objects(feed.metrics) == [{"step": 0, "pass_rate": 0.5}]  # the torn line is left out
    with pytest.raises(ProtocolError, match="not signed by"):
        open_feed(raw, now_ms=NOW, signer=MALLORY.peer_id, run_id="r1")
    with pytest.raises(ProtocolError, match="of run 'r1', not 'r2'"):
        open_feed(raw, now_ms=NOW, signer=NODE.peer_id, run_id="r2")
    with pytest.raises(MessageIgnored):
        open_feed(raw, now_ms=NOW + 3_600_000, signer=NODE.peer_id, run_id="r1")
    # Mallory's signature over a feed naming the node
    payload = codec.encode(_feed())
    forged = codec.encode(Envelope(domain=FEED_DOMAIN, payload=payload, signer=MALLORY.peer_id,
                                   signature=MALLORY.sign_bytes(FEED_DOMAIN, payload)))
    with pytest.raises(ProtocolError):
        open_feed(forged, now_ms=NOW, signer=MALLORY.peer_id, run_id="r1")
    with pytest.raises(ValueError):
        seal_feed(MALLORY, _feed())


def test_a_feed_is_bounded() -> None:
    with pytest.raises(ProtocolError, match="lines, at most"):
        seal_feed(NODE, _feed(metrics=["{}"] * (MAX_FEED_LINES + 1)))
    with pytest.raises(ProtocolError, match="over"):
        seal_feed(NODE, _feed(held_out=["x" * (MAX_LINE_BYTES + 1)]))
    with pytest.raises(ProtocolError, match="bytes, at most"):
        open_feed(b"\0" * (MAX_FEED_BYTES + 1), now_ms=NOW, signer=NODE.peer_id, run_id="r1")


@given(st.binary(max_size=2048))
def test_random_bytes_are_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        open_feed(raw, now_ms=NOW, signer=NODE.peer_id, run_id="r1")
