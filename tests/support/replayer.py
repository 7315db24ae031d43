"""A hostile replayer in an in-process run (``intellect_node.testing.roles``), and roles with the audit watch.

:class:`Replayer` is a node with a fresh key and no role that subscribes to every topic the run's nodes
use and, for each message it hears, does what a replayer on the real mesh can:

1. publishes the same signed bytes again as its own publication (``copies`` times), at once;
2. forwards the original publisher's message again with that publisher as its origin, as libp2p does
   with a message once the gossip seen-cache has forgotten it (the replay blamed on the signer if
   anything is);
3. keeps a copy, and on :meth:`replay_stale` sends every copy again both ways, the dated ones (batch
   verdicts, audit verdicts, held-out results) as they would be had they been captured ``age_ms``
   earlier: the same message with its stamp that much older, sealed by its signer (a test holds the
   honest keys, so it can make the bytes a capture of then would hold). Undated messages (notices,
   announcements, step records) go out as captured.

:func:`watched` builds a role on a node whose audit watch (``roles/common/audits.py``) runs as on a
joined node: registered before the role is made (a role asks ``runtime.service(AuditWatch)`` for its
``run.require_audits`` gate when it is built) and started before it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import msgspec

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.audits import AUDIT_DOMAIN, AuditVerdict
from intellect_node.protocol.evals import EVAL_DOMAIN, EvalResult
from intellect_node.protocol.rl import VERDICT_DOMAIN, BatchVerdict
from intellect_node.protocol.signing import Envelope, SigningKey
from intellect_node.protocol.topics import parse_topic
from intellect_node.roles.common.audits import AuditWatch
from intellect_node.testing.roles import InProcessNode, InProcessSwarm

DATED: dict[str, type[Any]] = {VERDICT_DOMAIN: BatchVerdict, AUDIT_DOMAIN: AuditVerdict,
                               EVAL_DOMAIN: EvalResult}
"""Envelope domains whose messages carry ``time_ms``, and their types."""


def watched(factory: Callable[[Any], Any]) -> Callable[[InProcessNode], Any]:
    """``factory`` (e.g. ``Worker.for_runtime``) on a node that runs the audit watch a joined node runs."""

    def build(node: InProcessNode) -> Any:
        watch = AuditWatch(node)  # the in-process node is a Runtime
        node.services[AuditWatch] = watch
        role = factory(node)
        start = role.start

        async def start_both() -> None:
            await watch.start()
            await start()

        role.start = start_both
        return role

    return build


class Replayer:
    """See the module docstring. ``keys``: the honest signers' keys by peer ID (for :meth:`replay_stale`)."""

    def __init__(self, net: InProcessSwarm, node: InProcessNode, keys: Iterable[SigningKey], *,
                 copies: int = 2) -> None:
        self.net = net
        self.node = node
        self.keys = {k.peer_id: k for k in keys}
        self.copies = copies
        self.held: list[tuple[str, str, bytes]] = []  # (topic, origin, data) of each message heard once
        self.sent: Counter[str] = Counter()  # topic kind -> copies published as its own
        self.forwarded: Counter[str] = Counter()  # topic kind -> copies forwarded as the origin's
        self.stale: Counter[str] = Counter()  # topic kind -> re-dated copies sent (both ways)
        self._seen: set[bytes] = set()
        self._jobs: set[asyncio.Task[None]] = set()

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    def listen(self) -> list[str]:
        """Subscribe to every topic a node of the run subscribes to; the topics."""
        others = [n for n in self.net.nodes.values() if n is not self.node]
        topics = sorted({t for n in others for t in n.swarm.subscriptions})
        for t in topics:
            self.node.swarm.subscribe(t, lambda data, origin: data, partial(self._heard, t))
        return topics

    def _heard(self, topic: str, data: bytes, origin: str) -> None:
        digest = hashlib.sha256(topic.encode() + b"\0" + data).digest()
        if digest in self._seen:
            return
        self._seen.add(digest)
        self.held.append((topic, origin, data))
        job = asyncio.ensure_future(self._replay(topic, origin, data))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _replay(self, topic: str, origin: str, data: bytes) -> None:
        kind = parse_topic(topic)[1]
        for _ in range(self.copies):
            await self.node.swarm.publish(topic, data)
            self.sent[kind] += 1
        self.forward(origin, topic, data)
        self.forwarded[kind] += 1

    def forward(self, origin: str, topic: str, data: bytes) -> None:
        """``data`` to every other running node as a message of ``origin``'s (what
        ``InProcessSwarm.gossip`` does, but not back to this node)."""
        loop = asyncio.get_running_loop()
        for n in list(self.net.nodes.values()):
            if n is not self.node and n.running:
                loop.call_soon(n.swarm.receive, origin, topic, data)

    async def replay_stale(self, age_ms: int) -> int:
        """Every message held, again, as its own publication and as its origin's, the dated ones
        ``age_ms`` older (see the module docstring); how many messages."""
        held = list(self.held)
        for topic, origin, data in held:
            kind = parse_topic(topic)[1]
            old = self.redate(data, age_ms)
            await self.node.swarm.publish(topic, old)
            self.forward(origin, topic, old)
            self.stale[kind] += 1
        return len(held)

    def redate(self, data: bytes, age_ms: int) -> bytes:
        """``data`` as captured ``age_ms`` earlier: a dated message's stamp moved back and sealed again by
        its signer; anything else (undated, unsigned, or of a signer whose key is not held) unchanged."""
        try:
            env = codec.decode(data, Envelope, max_size=1 << 24)
        except ProtocolError:  # a conflict proof is no envelope: it goes out as it is
            return data
        kind = DATED.get(env.domain)
        key = self.keys.get(env.signer)
        if kind is None or key is None:
            return data
        msg = codec.decode(env.payload, kind, max_size=1 << 24)
        stamp = getattr(msg, "time_ms", msgspec.UNSET)
        if not isinstance(stamp, int):
            return data
        return key.seal(env.domain, msgspec.structs.replace(msg, time_ms=stamp - age_ms))

    async def drain(self) -> None:
        """Wait for the replays under way."""
        while self._jobs:
            await asyncio.gather(*list(self._jobs), return_exceptions=True)
