"""A node's run feed: the trainer's metrics lines and the held-out results it holds, signed, for a report
made from the swarm (``intellect-node run report --run CID``).

A node of a run serves ``GET /feed/v1`` on its bulk HTTP port (``roles/common/feed.py``): one envelope
of :class:`RunFeed` signed by its key, with the newest :data:`MAX_FEED_LINES` lines of its
``trainer/metrics.jsonl`` (trainers) and of ``*/held_out.jsonl`` (validators that evaluate), each line
the JSON text as written. The reader checks the signature and the signer (the run's trainer for the
metrics, a validator for held-out results), the bounds before anything is allocated (the envelope's size,
the line counts and sizes), and that each line is one JSON object; a line that is not is left out.

What it is: the signer's word on its own figures, like its listing. The held-out results in it are the
validator's own records (it checked each one it took: ``roles/validator/evals.py``); the metrics are the
trainer's, which its signed step records and the auditors' replays bear out step by step, not line by
line. Shortcut: the newest lines only (a run of more steps is reported from its last
:data:`MAX_FEED_LINES`).
"""

from __future__ import annotations

from intellect_node.errors import ProtocolError
from intellect_node.fsutil import json_objects
from intellect_node.protocol import codec
from intellect_node.protocol.freshness import check_stamp
from intellect_node.protocol.signing import SigningKey, open_envelope
from intellect_node.protocol.topics import validate_run_id

FEED_DOMAIN = "intellect/run-feed/1"
FEED_HTTP_PATH = "/feed/v1"
MAX_FEED_LINES = 5000
"""Lines of each kind a feed carries (the newest): 5,000 steps of metrics."""
MAX_LINE_BYTES = 16 << 10
"""One metrics line is 1-3 KiB; a longer one is not sent."""
MAX_FEED_BYTES = 2 * MAX_FEED_LINES * 2048 + (1 << 20)
"""Bound on a feed's encoded size, checked before it is decoded (about 21 MiB)."""
MAX_FEED_AGE_MS = 10 * 60 * 1000


class RunFeed(codec.Message, frozen=True):
    node: str  # peer ID of the signer
    time_ms: int
    run_id: str
    metrics: list[str] = []  # trainer/metrics.jsonl lines, oldest first
    held_out: list[str] = []  # held_out.jsonl lines, oldest first


def check_feed(feed: RunFeed) -> RunFeed:
    validate_run_id(feed.run_id)
    for kind, lines in (("metrics", feed.metrics), ("held-out", feed.held_out)):
        if len(lines) > MAX_FEED_LINES:
            raise ProtocolError(f"a feed carries {len(lines)} {kind} lines, at most {MAX_FEED_LINES}")
        if any(len(line) > MAX_LINE_BYTES for line in lines):
            raise ProtocolError(f"a feed's {kind} line is over {MAX_LINE_BYTES} bytes")
    return feed


def seal_feed(key: SigningKey, feed: RunFeed) -> bytes:
    if feed.node != key.peer_id:
        raise ValueError("a feed is signed by the node it names")
    return key.seal(FEED_DOMAIN, check_feed(feed))


def open_feed(raw: bytes, *, now_ms: int, signer: str, run_id: str) -> RunFeed:
    """Decode and verify the feed ``signer`` served for ``run_id``. ProtocolError for anything wrong;
    ``MessageIgnored`` for a stamp off this clock."""
    if len(raw) > MAX_FEED_BYTES:
        raise ProtocolError(f"a feed of {len(raw)} bytes, at most {MAX_FEED_BYTES}")
    feed, by = open_envelope(raw, FEED_DOMAIN, RunFeed, max_size=MAX_FEED_BYTES)
    if feed.node != by or by != signer:
        raise ProtocolError(f"the feed is not signed by {signer}")
    if feed.run_id != run_id:
        raise ProtocolError(f"the feed is of run {feed.run_id!r}, not {run_id!r}")
    check_feed(feed)
    check_stamp(feed.time_ms, now_ms, max_age_ms=MAX_FEED_AGE_MS, max_ahead_ms=MAX_FEED_AGE_MS,
                what="run feed")
    return feed


def objects(lines: list[str]) -> list[dict[str, object]]:
    """A feed's lines that are one JSON object each (the others are left out)."""
    return [dict(doc) for doc in json_objects(lines)]
