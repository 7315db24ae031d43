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

Every blob is fetched with a size the run's model decides (:class:`StateSizes`: the exact size of its
weights file, a tight bound on its optimizer state's; a delta at most
:func:`~intellect_node.policy.delta.delta_size_limit` of the weights' size and of the size it was
announced at), refused before any chunk moves when its manifest says otherwise, from the trainer first
and the DHT second, and is used only when the result hashes to what the trainer signed. Weights and
optimizer states are assembled into a file and mapped (:func:`fetch_mapped`), never read into memory.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from intellect_node.errors import IntellectNodeError
from intellect_node.policy.delta import apply_delta, delta_size_limit
from intellect_node.policy.weights import PolicyWeights, file_size
from intellect_node.protocol.policy import DeltaLink, PolicyAnnouncement
from intellect_node.protocol.steps import StepRecord
from intellect_node.trainer.optstate import size_bound

log = logging.getLogger(__name__)

MAX_LINKS = 4096
"""Delta links (and anchors) kept, the newest versions first: an announcement carries at most
``protocol.policy.MAX_CHAIN``; this covers a lag of thousands of steps at a few hundred bytes each."""
FETCH_TIMEOUT_S = 600.0
"""A full weights blob is a model; a delta a fraction of it."""


@dataclass(frozen=True)
class StateSizes:
    """What the trainer's published files of the run's model measure, from the model as this node loads
    it (names, dtypes, shapes): ``weights`` exactly (``policy/weights.file_size``: the canonical header is
    implied by the layout), ``optimizer`` at most (``trainer/optstate.size_bound``: exact once every
    parameter has taken a step, smaller for a state of fewer parameters)."""

    weights: int
    optimizer: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "StateSizes":
        return cls(file_size(model.state_dict()), size_bound(list(model.parameters())))


class PublishedUnavailable(IntellectNodeError):
    """The published weights or optimizer state of a step could not be had (the message says why)."""


class BlobFetch(Protocol):
    """What fetches a blob: ``roles/common/fetch.HintedFetcher``."""

    async def fetch(self, cid: str, *, holders: Sequence[str], max_size: int, size: int | None = None,
                    timeout: float) -> bytes: ...

    async def fetch_file(self, cid: str, out: Path, *, holders: Sequence[str], max_size: int,
                         size: int | None = None, timeout: float) -> Path: ...


async def fetch_mapped(fetcher: BlobFetch, cid: str, out: Path, *, holders: Sequence[str], max_size: int,
                       size: int | None = None, timeout: float) -> PolicyWeights:
    """Blob ``cid`` (a canonical tensor file within ``max_size``, of ``size`` bytes when given) fetched
    into the file ``out`` and mapped read-only; the file's name is removed at once (the mapping holds
    it until dropped). The fetch's errors as raised; ProtocolError when the file is not canonical."""
    path = await fetcher.fetch_file(cid, out, holders=holders, max_size=max_size, size=size, timeout=timeout)
    try:
        return await asyncio.to_thread(PolicyWeights.load, path, max_size=max_size)
    finally:
        path.unlink(missing_ok=True)


State = Mapping[str, torch.Tensor]


class PublishedPolicy:
    """Published weights and optimizer states of the run's trainer ``trainer``, by the step records'
    hashes (see the module docstring)."""

    def __init__(self, fetcher: BlobFetch, trainer: str, directory: Path,
                 sizes: StateSizes | None = None) -> None:
        self._fetcher = fetcher
        self._trainer = trainer
        self._dir = directory  # where fetched weights and optimizer states are assembled (then mapped)
        self.sizes = sizes
        """The run's model's sizes (:class:`StateSizes`); the chain auditor sets them once it loaded the
        model, before any replay asks for a published blob."""
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

    def _sizes(self) -> StateSizes:
        if self.sizes is None:
            raise PublishedUnavailable("the run's model is not loaded yet: no size to fetch against")
        return self.sizes

    async def _fetch(self, cid: str, max_size: int, size: int | None = None) -> bytes:
        try:
            return await self._fetcher.fetch(cid, holders=[self._trainer], max_size=max_size, size=size,
                                             timeout=FETCH_TIMEOUT_S)
        except (IntellectNodeError, asyncio.TimeoutError) as exc:
            raise PublishedUnavailable(f"blob {cid} not fetched: {exc or 'timed out'}") from exc

    async def _mapped(self, cid: str, what: str, expected: str, *, max_size: int,
                      size: int | None = None) -> PolicyWeights:
        """Blob ``cid`` fetched into a file and mapped, hash-checked against ``expected``."""
        try:
            out = await fetch_mapped(self._fetcher, cid, self._dir / f"{cid}.safetensors",
                                     holders=[self._trainer], max_size=max_size, size=size,
                                     timeout=FETCH_TIMEOUT_S)
        except (IntellectNodeError, OSError, asyncio.TimeoutError) as exc:  # OSError: this node's disk
            raise PublishedUnavailable(f"blob {cid} not fetched or not a tensor file: "
                                       f"{exc or 'timed out'}") from exc
        if out.content_hash != expected:
            raise PublishedUnavailable(f"the published {what} hash to {out.content_hash}, the record says "
                                       f"{expected}")
        return out

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
        if cid is None and rec.checkpoint_hash in self._full:
            _, cid, _ = self._full[rec.checkpoint_hash]  # its announced size is checked as the model's
        if cid is None:
            raise PublishedUnavailable(f"{tried}no delta or full weights of v{rec.version} "
                                       f"({rec.checkpoint_hash}) announced")
        size = self._sizes().weights
        out = await self._mapped(cid, "weights", rec.checkpoint_hash, max_size=size, size=size)
        self.fetched["full"] += 1
        return out

    async def _by_delta(self, rec: StepRecord, link: DeltaLink, base: State) -> PolicyWeights:
        size = self._sizes().weights
        limit = delta_size_limit(size)
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
                return apply_delta(held, data, expected_hash=rec.checkpoint_hash, max_size=size)
            except IntellectNodeError as exc:
                raise PublishedUnavailable(f"the delta to v{rec.version} does not apply: {exc}") from exc

        out = await asyncio.to_thread(apply)
        self.fetched["delta"] += 1
        return out

    async def optimizer(self, rec: StepRecord) -> PolicyWeights:
        """The optimizer state published with ``rec`` (a record carrying ``state``), hash-checked."""
        if rec.state is None:
            raise PublishedUnavailable(f"step {rec.seq} published no optimizer state")
        out = await self._mapped(rec.state.optimizer_cid, "optimizer state", rec.state.optimizer_hash,
                                 max_size=self._sizes().optimizer)
        self.fetched["optimizer"] += 1
        return out

    def blocking(self, loop: asyncio.AbstractEventLoop
                 ) -> tuple[Callable[[StepRecord, State], PolicyWeights | None],
                            Callable[[StepRecord], PolicyWeights | None]]:
        """:meth:`weights` and :meth:`optimizer` for a worker thread (never the loop's own): each runs on
        ``loop`` and is waited for; None (logged) when it raised :class:`PublishedUnavailable`."""

        def wait(coro: Coroutine[object, None, PolicyWeights], what: str) -> PolicyWeights | None:
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

