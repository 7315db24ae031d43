"""Fetching blobs whose holder is known (a notice's signer, a verdict's worker and validator)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from intellect_node.blobs.fetch import Budget
from intellect_node.blobs.service import BlobService
from intellect_node.errors import IntegrityError
from intellect_node.protocol.blob import Manifest
from intellect_node.roles.common.seams import RoleSwarm

if TYPE_CHECKING:
    from intellect_node.blobs.fetch import FetchStats, Provider

log = logging.getLogger(__name__)

ANNOUNCE_MIN_CHUNKS = 4
"""A blob a role fetched is announced in the DHT from this many chunks (12 MiB at the default 3 MiB
chunks): large enough that its followers gain from fetching from each other (see ``HintedFetcher``)."""


class WrongSize(IntegrityError):
    """A blob's manifest states another size than the one asked for, or more than the limit: refused
    before any chunk of it moves.

    A manifest is what its CID names, whoever serves it: the fault is whoever named that CID for a blob
    of that size (a step record's signer, a notice's), not the provider."""

    def __init__(self, cid: str, held: int, expected: str) -> None:
        super().__init__(f"blob {cid} holds {held} bytes, {expected} expected")
        self.cid, self.held = cid, held


@dataclass(frozen=True)
class _Budget(Budget):
    """:class:`~intellect_node.blobs.fetch.Budget` whose size refusals are :class:`WrongSize`."""

    def check(self, cid: str, m: Manifest) -> None:
        if self.size is not None and m.total_size != self.size:
            raise WrongSize(cid, m.total_size, f"{self.size}")
        if m.total_size > self.max_size:
            raise WrongSize(cid, m.total_size, f"at most {self.max_size}")
        super().check(cid, m)


class HintedFetcher:
    """Fetches blobs whose holder is known (a notice's signer, a verdict's worker and validator).

    The node that announced a blob is its first provider, and its HTTP URL is in its heartbeats; asking
    it directly avoids depending on a DHT provider record that may not have reached the peers we know
    yet (it is made a moment before the notice). Every chunk is hash-checked by the fetcher as usual, so
    a hint can only cost time, never inject bytes.

    The first lookup of a blob answers with the hinted holders alone; every later one (a fetch looking
    again while it downloads from the holder alone, or after its providers failed) adds what the DHT
    knows. A fetched blob of ANNOUNCE_MIN_CHUNKS chunks or more is announced in the DHT as soon as its
    manifest is in, so the followers of a large policy find each other and take chunks from each other
    instead of all from the trainer (docs/training.md, "Blob fetching in the roles"). Smaller blobs (a
    policy delta, a rollout batch) are not: a provider record costs every node DHT traffic, and the
    holder serves them in a moment.
    """

    def __init__(self, blobs: BlobService, swarm: RoleSwarm) -> None:
        from intellect_node.blobs.fetch import Fetcher
        from intellect_node.blobs.http import HttpChunkSource

        self.blobs = blobs
        self.swarm = swarm
        self._http = HttpChunkSource(addresses=blobs.addresses)  # a peer's URL leads only to that peer
        self._hints: dict[str, list[str]] = {}  # CID -> holders named by the fetches under way
        self._looked: set[str] = set()  # CIDs whose hinted-only first lookup was answered
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # CID -> (one fetch at a time, users)
        # The blob service's other sources too: a holder behind NAT advertises ``p2p://`` and serves
        # over the libp2p chunk stream (p2p/nat); with HTTP alone its batches could not be fetched.
        self._fetcher = Fetcher(blobs.store, [*blobs.extra_sources, self._http], self._find,
                                self_peer_id=swarm.peer_id,
                                penalise=swarm.peerbook.record_rejection, is_banned=swarm.peerbook.is_banned)

    async def _find(self, cid: str) -> Sequence[Provider]:
        from intellect_node.blobs.fetch import StaticProvider

        hinted: list[Provider] = [StaticProvider(p, url) for p in dict.fromkeys(self._hints.get(cid, []))
                                  if (url := self.swarm.peerbook.http_url(p))]
        if hinted and cid not in self._looked:
            self._looked.add(cid)
            return hinted
        named = {p.peer_id for p in hinted}
        return hinted + [p for p in await self.swarm.find_providers(cid) if p.peer_id not in named]

    def _seen(self, cid: str, check: Callable[[Manifest], None] | None) -> Callable[[Manifest], None]:
        """``check``, then announce a large blob (see the class docstring) once its manifest passed."""
        def on_manifest(m: Manifest) -> None:
            if check is not None:
                check(m)
            if len(m.chunks) >= ANNOUNCE_MIN_CHUNKS:
                self.blobs.announce(cid)
        return on_manifest

    async def fetch(self, cid: str, *, holders: Sequence[str], max_size: int, size: int | None = None,
                    timeout: float) -> bytes:
        """The content of blob ``cid``; refuses a manifest over ``max_size`` (or other than ``size``:
        :class:`WrongSize`) before any chunk is fetched."""
        await self._complete(cid, holders, max_size, size, timeout)
        return bytes(await asyncio.to_thread(self.blobs.store.read, cid))

    async def fetch_file(self, cid: str, out: str | os.PathLike[str], *, holders: Sequence[str],
                         max_size: int, size: int | None = None, timeout: float) -> Path:
        """Blob ``cid`` assembled into the file ``out`` (kernel-side copies from the store's chunks:
        none of it passes through this process's memory); ``out``. Refused as in :meth:`fetch`."""
        await self._complete(cid, holders, max_size, size, timeout)
        return await asyncio.to_thread(self.blobs.store.export, cid, out)

    async def _complete(self, cid: str, holders: Sequence[str], max_size: int, size: int | None,
                        timeout: float) -> None:
        """Blob ``cid`` complete in the store, within ``max_size`` (and of ``size`` bytes when given)."""
        budget = _Budget(max_size=max_size, size=size)

        async def fetch_one() -> None:
            lock, users = self._locks.get(cid, (asyncio.Lock(), 0))
            self._locks[cid] = (lock, users + 1)
            try:
                async with lock:
                    m = self.blobs.store.manifest(cid)
                    if m is not None:
                        budget.check(cid, m)
                    if m is None or self.blobs.store.missing(cid):
                        # The budget is checked before the manifest is stored (blobs/fetch.py, Budget).
                        await self._fetcher.fetch(cid, on_manifest=self._seen(cid, None), budget=budget)
            finally:
                lock, users = self._locks[cid]
                if users > 1:
                    self._locks[cid] = (lock, users - 1)
                else:
                    del self._locks[cid]

        # Concurrent fetches of one CID (two notices naming it) pool their hints and take turns.
        self._hints.setdefault(cid, []).extend(holders)
        try:
            await asyncio.wait_for(fetch_one(), timeout)
        finally:
            self._unhint(cid, holders)

    def _unhint(self, cid: str, holders: Sequence[str]) -> None:
        left = self._hints.get(cid, [])
        for h in holders:
            if h in left:
                left.remove(h)
        if not left:
            self._hints.pop(cid, None)
            self._looked.discard(cid)

    def holding(self, holders: Sequence[str]) -> _HintedBlobs:
        """A ``BlobService`` stand-in for ``PolicyFollower``: fetches try ``holders`` (the trainer) first."""
        return _HintedBlobs(self, list(holders))

    def close(self) -> None:
        self._http.close()


class _HintedBlobs:
    """What ``PolicyFollower`` uses of a BlobService (``store``, ``fetch``), with a standing hint."""

    def __init__(self, owner: HintedFetcher, holders: list[str]) -> None:
        self._owner = owner
        self._holders = holders
        self.store = owner.blobs.store

    async def fetch(self, cid: str, *, on_manifest: Callable[[Manifest], None] | None = None) -> FetchStats:
        o = self._owner
        o._hints.setdefault(cid, []).extend(self._holders)
        try:
            return await o._fetcher.fetch(cid, on_manifest=o._seen(cid, on_manifest))
        finally:
            o._unhint(cid, self._holders)
