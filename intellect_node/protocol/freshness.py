"""The one rule for signed messages that are dated: outside its window, a message is ignored, not refused.

Anyone can keep a signed message and publish it again later, and a peer whose libp2p message is
forwarded again once the gossip seen-cache forgot it is its origin once more. So a message whose stamp
is too old (or too far ahead) says nothing about its signer or its forwarder: :func:`check_stamp` raises
:class:`~intellect_node.errors.MessageIgnored` (the gossip validator drops it, forwards it to no one
and blames no one), never a plain ``ProtocolError``. The same goes for a repeat of a message already
taken: :class:`SeenDigests` remembers the signed contents a receiver took, bounded, so a repeat is
ignored as ``kind="repeat"``. Used by heartbeats (``gossip``), run listings (``run_manifest``), sweep
messages (``sweep``) and audit verdicts (``audits``); batch verdicts keep their own window
(``rl.verdict_time_error``), with the same outcome.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from intellect_node.errors import MessageIgnored

MAX_SEEN = 16384
"""Signed contents a :class:`SeenDigests` remembers (32 bytes each, about 1 MB with the dict)."""


def check_stamp(time_ms: int, now_ms: int, *, max_age_ms: int, max_ahead_ms: int, what: str) -> None:
    """Raise ``MessageIgnored`` (kind ``stale``) unless ``time_ms`` (the signer's clock, unix ms) is at
    most ``max_age_ms`` behind ``now_ms`` (ours) and at most ``max_ahead_ms`` ahead of it."""
    if time_ms < now_ms - max_age_ms:
        raise MessageIgnored(f"{what} sealed {(now_ms - time_ms) / 1000:.0f} s ago (replayed, or a clock "
                             "behind)")
    if time_ms > now_ms + max_ahead_ms:
        raise MessageIgnored(f"{what} dated {(time_ms - now_ms) / 1000:.0f} s ahead (a clock ahead)")


class SeenDigests:
    """The signed contents taken lately, newest last: :meth:`take` refuses the same bytes twice. Not
    thread-safe: one gossip validator (the trio thread) uses one."""

    def __init__(self, limit: int = MAX_SEEN) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._limit = limit

    def take(self, signer: str, payload: bytes, *, what: str) -> None:
        """Remember ``payload`` signed by ``signer``; ``MessageIgnored`` (kind ``repeat``) when it was
        taken before. Past the limit the oldest is forgotten: a repeat of that one is taken again, which
        is as harmless as its first copy (the caller's state deduplicates what it counts)."""
        digest = hashlib.sha256(signer.encode() + b"\0" + payload).digest()
        if digest in self._seen:
            self._seen.move_to_end(digest)
            raise MessageIgnored(f"{what} already taken (a repeat)", kind="repeat")
        self._seen[digest] = None
        while len(self._seen) > self._limit:
            self._seen.popitem(last=False)
