"""The weights and optimizer state the trainer published for a step, for audits within a tolerance.

A replay that is bitwise needs nothing published but the records' hashes. One that is not (the auditor's
kernels or thread count differ from the trainer's, ``tolerance.py``) compares its step with the published
weights and goes on from them, so it needs version v's weights themselves. :class:`PublishedPolicy` gets
them the cheapest way that ends at the record's ``checkpoint_hash``:

1. the delta to v (``policy/delta.py``) applied to the weights the step started from, which the replay
   holds (it checked their hash, the record's ``base_hash``, before the step). The delta's link comes
   from the trainer's signed policy announcements (:meth:`PublishedPolicy.heard`, every announcement the
   node hears on the run's ``policy`` topic): a link whose base and target are the record's hashes. The
   node's policy follower has usually fetched that delta into the same blob store already, so it costs
   nothing on the wire; otherwise a fraction of the model;
2. else the full weights blob: the record's own ``state.weights_cid`` (a checkpointed step) or an
   announced anchor whose hash is the record's; the whole model.

Every blob is fetched with a size bound (the announced delta size, at most
:func:`~intellect_node.policy.delta.delta_size_limit`; :data:`MAX_POLICY_BYTES` for weights), from the
trainer first and the DHT second, and is used only when the result hashes to what the trainer signed.
Whatever goes wrong (no link or blob known, a fetch that fails or times out, a blob that is malformed or
hashes otherwise) raises :class:`PublishedUnavailable`, which the replay reports ``unavailable``: never
a pass. At a checkpoint the optimizer state the trainer published (``state.optimizer_cid``) is got
the same way (:meth:`PublishedPolicy.optimizer`).

The replay runs in a worker thread and asks for these while it runs (only a step whose hash differs
needs them); :meth:`PublishedPolicy.blocking` gives it functions that run the fetch on the event loop
(``asyncio.run_coroutine_threadsafe``) and wait for it.

Shortcuts: links are kept for the newest :data:`MAX_LINKS` versions heard, from the announcements heard
while the node runs (an auditor that joins after a delta's anchor was replaced in the announcements, or
lags more than that, fetches full weights instead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol, Sequence

import torch

from intellect_node.errors import IntellectNodeError
from intellect_node.policy.delta import apply_delta, delta_size_limit
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import DeltaLink, PolicyAnnouncement
from intellect_node.protocol.steps import StepRecord
from intellect_node.roles.common.models import MAX_POLICY_BYTES

log = logging.getLogger(__name__)

MAX_LINKS = 4096
"""Delta links (and anchors) kept, the newest versions first: an announcement carries at most
``protocol.policy.MAX_CHAIN``; this covers a lag of thousands of steps at a few hundred bytes each."""
FETCH_TIMEOUT_S = 600.0
"""A full weights blob is a model; a delta a fraction of it."""
MAX_OPTIMIZER_BYTES = 2 * MAX_POLICY_BYTES + (16 << 20)
"""AdamW holds two moments per weight (the same dtype) and a scalar step per tensor, with its header."""


class PublishedUnavailable(IntellectNodeError):
    """The published weights or optimizer state of a step could not be had (the message says why)."""


class BlobFetch(Protocol):
    """What fetches a blob: ``roles/common/fetch.HintedFetcher``."""

    async def fetch(self, cid: str, *, holders: Sequence[str], max_size: int, size: int | None = None,
                    timeout: float) -> bytes: ...


State = Mapping[str, torch.Tensor]


class PublishedPolicy:
    """Published weights and optimizer states of the run's trainer ``trainer``, by the step records'
    hashes (see the module docstring)."""

    def __init__(self, fetcher: BlobFetch, trainer: str) -> None:
        self._fetcher = fetcher
        self._trainer = trainer
        self._links: dict[str, DeltaLink] = {}  # target hash -> the link leading there
        self._full: dict[str, tuple[int, str, int]] = {}  # hash -> (version, full CID, size)
        self.fetched = {"delta": 0, "full": 0, "optimizer": 0}  # blobs used, by kind (status)

    def heard(self, ann: PolicyAnnouncement) -> None:
        """Note the links and anchor of an announcement (checked and signed by the run's trainer: the
        gossip validator let it through)."""
        for link in ann.deltas:
            self._links.setdefault(link.target_hash, link)
        try:
            self._full.setdefault(ann.full_hash, (ann.full_version, ann.full_cid, ann.full_size))
        except KeyError:  # the links do not reach back to the anchor: its hash is not announced here
            pass
        if len(self._links) > MAX_LINKS:
            for h in sorted(self._links, key=lambda h: self._links[h].version)[:len(self._links) - MAX_LINKS]:
                del self._links[h]
        if len(self._full) > MAX_LINKS:
            for h in sorted(self._full, key=lambda h: self._full[h][0])[:len(self._full) - MAX_LINKS]:
                del self._full[h]

    async def _fetch(self, cid: str, max_size: int, size: int | None = None) -> bytes:
        try:
            return await self._fetcher.fetch(cid, holders=[self._trainer], max_size=max_size, size=size,
                                             timeout=FETCH_TIMEOUT_S)
        except (IntellectNodeError, asyncio.TimeoutError) as exc:
            raise PublishedUnavailable(f"blob {cid} not fetched: {exc or 'timed out'}") from exc

    async def weights(self, rec: StepRecord, base: State) -> PolicyWeights:
        """The weights ``rec`` says its step made (hash ``rec.checkpoint_hash``); ``base``: the weights it
        started from, as the replay holds them (hash ``rec.base_hash``)."""
        link = self._links.get(rec.checkpoint_hash)
        tried = ""
        if link is not None and link.base_hash == rec.base_hash:
            try:
                return await self._by_delta(rec, link, base)
            except PublishedUnavailable as exc:
                tried = f"{exc}; "
                log.warning("audit of step %d: the delta to v%d: %s; trying the full weights", rec.seq,
                            rec.version, exc)
        cid = rec.state.weights_cid if rec.state is not None else None
        size: int | None = None
        if cid is None and rec.checkpoint_hash in self._full:
            _, cid, size = self._full[rec.checkpoint_hash]
        if cid is None:
            raise PublishedUnavailable(f"{tried}no delta or full weights of v{rec.version} "
                                       f"({rec.checkpoint_hash}) announced")
        data = await self._fetch(cid, MAX_POLICY_BYTES, size)
        out = await asyncio.to_thread(_parse, data, MAX_POLICY_BYTES, rec.checkpoint_hash, "weights")
        self.fetched["full"] += 1
        return out

    async def _by_delta(self, rec: StepRecord, link: DeltaLink, base: State) -> PolicyWeights:
        limit = delta_size_limit(MAX_POLICY_BYTES)
        if link.delta_size > limit:
            raise PublishedUnavailable(f"the delta to v{rec.version} is announced at {link.delta_size} "
                                       f"bytes, over {limit}")
        data = await self._fetch(link.delta_cid, limit, link.delta_size)

        def apply() -> PolicyWeights:
            held = PolicyWeights.from_state_dict(base)
            if held.content_hash != rec.base_hash:  # the caller's mistake, not the trainer's
                raise PublishedUnavailable(f"the base held hashes to {held.content_hash}, not the record's "
                                           f"{rec.base_hash}")
            try:
                return apply_delta(held, data, expected_hash=rec.checkpoint_hash, max_size=MAX_POLICY_BYTES)
            except IntellectNodeError as exc:
                raise PublishedUnavailable(f"the delta to v{rec.version} does not apply: {exc}") from exc

        out = await asyncio.to_thread(apply)
        self.fetched["delta"] += 1
        return out

    async def optimizer(self, rec: StepRecord) -> PolicyWeights:
        """The optimizer state published with ``rec`` (a record carrying ``state``), hash-checked."""
        if rec.state is None:
            raise PublishedUnavailable(f"step {rec.seq} published no optimizer state")
        data = await self._fetch(rec.state.optimizer_cid, MAX_OPTIMIZER_BYTES)
        out = await asyncio.to_thread(_parse, data, MAX_OPTIMIZER_BYTES, rec.state.optimizer_hash,
                                      "optimizer state")
        self.fetched["optimizer"] += 1
        return out

    def blocking(self, loop: asyncio.AbstractEventLoop
                 ) -> tuple[Callable[[StepRecord, State], PolicyWeights | None],
                            Callable[[StepRecord], PolicyWeights | None]]:
        """:meth:`weights` and :meth:`optimizer` for a worker thread (never the loop's own): each runs on
        ``loop`` and is waited for; None (logged) when it raised :class:`PublishedUnavailable`."""

        def wait(coro: Coroutine[Any, Any, PolicyWeights], what: str) -> PolicyWeights | None:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
            try:
                return fut.result(timeout=2 * FETCH_TIMEOUT_S)
            except PublishedUnavailable as exc:
                log.warning("%s: %s", what, exc)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                fut.cancel()
                log.warning("%s: not had in time (or the node is stopping)", what)
            return None

        def weights(rec: StepRecord, base: State) -> PolicyWeights | None:
            return wait(self.weights(rec, base), f"published weights of v{rec.version}")

        def optimizer(rec: StepRecord) -> PolicyWeights | None:
            return wait(self.optimizer(rec), f"published optimizer state of v{rec.version}")

        return weights, optimizer


def _parse(data: bytes, max_size: int, expected: str, what: str) -> PolicyWeights:
    try:
        out = PolicyWeights.parse(data, max_size=max_size)
    except IntellectNodeError as exc:
        raise PublishedUnavailable(f"the published {what} do not parse: {exc}") from exc
    if out.content_hash != expected:
        raise PublishedUnavailable(f"the published {what} hash to {out.content_hash}, the record says "
                                   f"{expected}")
    return out
