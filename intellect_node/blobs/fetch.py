"""Swarming download of one blob: many providers in parallel, every chunk hash-checked on arrival.

The fetcher
- gets the signed manifest from any provider (checked against the blob CID and its signature),
- asks each provider which chunks it holds (``/have`` bitmap; partial holders serve what they have),
- runs a few workers per provider that take the next missing chunk that provider holds, stream it
  through a :class:`~intellect_node.blobs.store.ChunkWriter` (hash while writing) and commit it
  (rename into place once verified), so a killed download resumes from the chunks on disk,
- sends a chunk that failed elsewhere: a transport failure (reset, timeout, 404) only skips that provider
  for that chunk, and a provider that fails several times in a row is dropped; bytes that do not match
  the CID drop the provider for the whole fetch and are reported through ``penalise`` (the peerbook),
- reports each committed chunk through ``on_progress``.

Which chunk next, from a given provider (what decides a broadcast over real links, where the origin's
uplink is the limit; measured in bench/broadcast_links.py):

- rarest first: among the chunks this provider can give, the one the fewest known providers hold (from
  their ``/have`` bitmaps), ties broken by a per-fetch random order, so peers that start together pull
  different chunks and then serve them to each other;
- a seed already sending a chunk to another peer answers "busy" (``X-Blob-If-Idle``, see
  ``blobs/http.py``, which also paces a seed's sends one at a time) and is asked for another: peers
  that picked the same rare chunk at once do not both pull it through the origin's uplink. Only a seed
  is asked this way; a partial holder serves whoever asks (refusing held every chunk to one receiver
  at a time);
- the seed is spared: a complete provider (the origin) is not asked for a chunk that a responsive
  partial holder (heard from within :data:`SPARE_FRESH_S`: a bitmap or chunk bytes) could give, even if
  that holder is busy, and while partial holders exist it gets :data:`SEED_REQUESTS` requests at a time
  from this fetch. The origin's uplink then carries chunks nobody else has yet, each about once, and
  what peers already hold travels between peers. A holder that went silent (frozen, unreachable) stops
  holding chunks back within a second: the seed serves them. Once every chunk this fetch still needs
  is held by some partial holder, the seed has nothing unique left and is asked like anyone (its
  uplink would otherwise idle through the last chunks).

End game: when every missing chunk is in flight, idle workers duplicate requests that have been slow
(:data:`ENDGAME_AFTER_S`, or twice this fetch's mean chunk time if that is longer: on a slow link every
chunk takes seconds and is not late), preferring a partial holder to the seed; the first copy wins and
cancels the other.

Shortcuts: no upload slots on a partial holder (four slots measured slower, docs/blobs.md); requests
that two peers make of the origin at the same moment for the same rare chunk are not coordinated
beyond its busy answers (random order makes them rare).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from intellect_node.blobs.addresses import AddressRefused
from intellect_node.blobs.http import ChunkBusy, ChunkSink
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import (
    ChunkUnavailable,
    IntegrityError,
    IntellectNodeError,
    ProtocolError,
    TransportError,
)
from intellect_node.protocol.blob import Have, Manifest, decode_have, open_manifest
from intellect_node.protocol.ids import CID_STR_LEN, cid_of

log = logging.getLogger(__name__)

PER_PROVIDER = 2
"""Concurrent chunk requests per provider: two keeps a connection busy while the other finishes its
fsync, without letting one provider hog the whole budget."""

MAX_INFLIGHT = 8
"""Concurrent chunk requests per fetch, all providers together (bounded memory and sockets)."""

MAX_CONSECUTIVE_FAILURES = 3
HAVE_REFRESH_S = 0.2
"""How often a fetch re-asks each partial holder for its bitmap when the holder answers at once (an
earlier version, or it does not know the blob yet)."""

HAVE_MIN_INTERVAL_S = 0.05
"""At most one bitmap per provider this often, held open or not: on a fast link chunks land every few
milliseconds, and a bitmap for each cost CPU the chunks needed (4 peers on loopback: 2.8-2.9 CPU s/GB
without this floor, 2.4-2.6 with it; bench/README.md, "broadcast")."""

HAVE_WAIT_S = 0.5
"""How long a partial holder may hold a bitmap request open while it has nothing new. Below
SPARE_FRESH_S: a quiet holder still answers often enough to count as responsive."""

ENDGAME_AFTER_S = 1.0
"""End game: once every missing chunk is in flight, an idle worker duplicates a request that has been
running this long at another provider; the first copy to arrive wins and cancels the other. A frozen or
slow provider then delays the tail by about this much instead of its 15 s read timeout. The threshold
keeps fast links (a 4 MiB chunk in tens of ms on a LAN) from doubling their last requests."""

SPARE_FRESH_S = 1.0
"""A partial holder spares the seed only while it was heard from this recently (its bitmap, asked every
HAVE_REFRESH_S by an idle worker, or bytes of a chunk it is sending): one that went silent (frozen,
unreachable) stops holding chunks back within this time."""

SEED_REQUESTS = 1
"""Requests in flight to one complete provider per fetch while partial holders exist. Each request the
origin serves at once splits its uplink further, so every chunk takes longer to reach its first peer
(and be served on from there), and requests of different peers for the same rare chunk overlap more
often (bench/README.md, "broadcast": with 2 per peer the origin sent 1.6 copies of the file)."""

BUSY_RETRY_S = 0.5
"""A provider that answered "busy with this chunk" (X-Blob-Busy: sending it to another peer) is not
asked for it again for this long; meanwhile the chunk may appear at that other peer."""

STALL_S = 15.0
"""A pass over the current providers ends when no chunk arrived for this long and none is in flight
(partial holders that never gain the missing chunks); the fetch then looks for providers again."""

REDISCOVER_ROUNDS = 5
"""How many times a fetch looks for providers again when all it knows have dropped out."""

REDISCOVER_DURING_S = 2.0
"""While a pass knows no partial holder (the DHT named only the publisher when the fetch began, as for
a policy just announced), it looks for providers again after this long, then at doubling intervals up
to REDISCOVER_DURING_MAX_S: peers fetching the same blob announce themselves once they hold its
manifest, and taking chunks from them spares the publisher's uplink."""

REDISCOVER_DURING_MAX_S = 30.0

FIND_TIMEOUT_S = 30.0
"""While no provider has answered yet, a fetch keeps looking this long, beyond REDISCOVER_ROUNDS: a
provider record takes a moment to reach the peers close to the key (a ``blob put`` on another node a
second ago, a node behind NAT announcing through its relays, a loaded machine)."""


class Provider(Protocol):
    """A peer that may hold a blob: what ``swarm.find_providers`` returns."""

    @property
    def peer_id(self) -> str: ...

    @property
    def http_url(self) -> str: ...


@dataclass(frozen=True)
class StaticProvider:
    """A provider known by address (tests, benchmarks, peers given on the command line)."""

    peer_id: str
    http_url: str


class ChunkSource(Protocol):
    """How bytes are pulled from one provider. HTTP by default; a libp2p-stream source can be added for
    peers HTTP cannot reach. Errors: TransportError (incl. ChunkUnavailable) for "try elsewhere",
    IntegrityError / ProtocolError for "this peer sent bad data"."""

    def accepts(self, provider: Provider) -> bool: ...

    async def get_manifest(self, provider: Provider, cid: str) -> bytes: ...

    async def get_have(self, provider: Provider, manifest_cid: str) -> bytes: ...

    async def read_chunk(self, provider: Provider, cid: str, length: int, sink: ChunkSink) -> None: ...


@runtime_checkable
class IdleAwareSource(Protocol):
    """What a :class:`ChunkSource` adds when it can ask the provider "only if you are not sending this
    chunk" (blobs/http.py): with ``speaks_if_idle`` true, its ``read_chunk`` takes ``if_idle``."""

    speaks_if_idle: bool

    async def read_chunk(self, provider: Provider, cid: str, length: int, sink: ChunkSink, *,
                         if_idle: bool = ...) -> None: ...


@dataclass(frozen=True)
class Progress:
    """One committed chunk."""

    manifest_cid: str
    index: int
    chunk_bytes: int
    provider: str  # peer ID it came from
    chunks_done: int
    chunks_total: int
    bytes_done: int
    bytes_total: int
    seconds: float = 0.0  # how long its request took (0 for a chunk found on disk)


@dataclass
class FetchStats:
    chunks_fetched: int = 0
    chunks_resumed: int = 0  # already on disk when the fetch started
    bytes_fetched: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # peer ID -> transport failures
    lookups: list[str] = field(default_factory=list)  # what each provider lookup found, for the error
    bad: dict[str, str] = field(default_factory=dict)  # peer ID -> why it was dropped as malicious
    endgame_requests: int = 0  # duplicate requests for chunks slow to arrive elsewhere
    busy_answers: int = 0  # "sending this chunk to another peer right now" (X-Blob-Busy)
    by_provider: dict[str, int] = field(default_factory=dict)  # peer ID -> chunks received
    new_chunks: set[str] = field(default_factory=set)  # chunk CIDs this fetch committed
    seconds: float = 0.0


MIN_BUDGET_CHUNK = 256 * 1024
"""Under a :class:`Budget` a blob larger than one chunk must use chunks of at least this size (the
smallest the roles publish: ``policy_chunk_mib`` >= 0.25; rollout batches use 3 MiB), so its manifest
lists at most one CID per 256 KiB it announces."""

MAX_CHUNK_REPEATS = 4
"""Under a :class:`Budget` one chunk CID may appear at most this often in a manifest: 16,384 copies of
one tiny chunk make a blob as large as announced that costs its sender nothing to serve."""


@dataclass(frozen=True)
class Budget:
    """What a blob named by an unproven peer may be; checked on its manifest before it is stored.

    ``size`` is what the peer announced (the manifest must say exactly that), ``max_size`` the caller's
    limit. The manifest's bytes, chunk count and repeated chunks are bounded by the announced size
    (:data:`MIN_BUDGET_CHUNK`, :data:`MAX_CHUNK_REPEATS`). A refusal is an IntegrityError: the blob is
    not what it should be, whoever serves it."""

    max_size: int
    size: int | None = None

    def max_manifest_bytes(self) -> int:
        """Envelope bytes a manifest within this budget can take (name, key, signature, CIDs)."""
        total = self.max_size if self.size is None else min(self.size, self.max_size)
        return 2048 + (1 + total // MIN_BUDGET_CHUNK) * (CID_STR_LEN + 2)

    def check(self, cid: str, m: Manifest) -> None:
        if m.total_size > self.max_size or (self.size is not None and m.total_size != self.size):
            raise IntegrityError(f"blob {cid} holds {m.total_size} bytes (announced {self.size}, "
                                 f"limit {self.max_size})")
        if len(m.chunks) > 1 and m.chunk_size < MIN_BUDGET_CHUNK:
            raise IntegrityError(f"blob {cid} is cut into {len(m.chunks)} chunks of {m.chunk_size} bytes "
                                 f"(at least {MIN_BUDGET_CHUNK} each expected)")
        if len(m.chunks) > MAX_CHUNK_REPEATS:
            counts: dict[str, int] = {}
            for c in m.chunks:
                if (n := counts.get(c, 0) + 1) > MAX_CHUNK_REPEATS:
                    raise IntegrityError(f"blob {cid} lists chunk {c[:16]}... more than "
                                         f"{MAX_CHUNK_REPEATS} times")
                counts[c] = n


def public_reason(exc: BaseException) -> str:
    """A fixed phrase for why a fetch failed, safe to publish (a verdict's detail): the exception's own
    text can carry a provider's address, port and error answers, which would make every published
    verdict a port-scan oracle for whoever chose the address."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "not served in time"
    if isinstance(exc, AddressRefused):
        return "the provider's address is not its own"
    if isinstance(exc, IntegrityError):
        return "the blob is not what was announced"
    if isinstance(exc, ProtocolError):
        return "malformed data"
    return "not served"


Penalise = Callable[[str, str], object]
"""``(peer_id, reason)``: the peerbook's ``record_rejection`` (what it returns is not used)."""
FindProviders = Callable[[str], Awaitable[Sequence[Provider]]]


@dataclass
class _Peer:
    provider: Provider
    source: ChunkSource
    have: Have | None = None
    complete: bool = False
    have_at: float = 0.0
    have_version: int | None = None  # its store's version with the bitmap we hold (long-poll)
    consecutive_failures: int = 0
    failed_chunks: set[int] = field(default_factory=set)
    dropped: bool = False
    busy: int = 0  # this fetch's requests to it in flight
    heard_at: float = 0.0  # when its bitmap or a piece of a chunk from it last arrived
    busy_until: dict[int, float] = field(default_factory=dict)  # chunk -> when to ask it again


class _Heard:
    """A chunk sink that notes when bytes last came from the provider (a busy holder is not silent)."""

    __slots__ = ("peer", "sink")

    def __init__(self, peer: _Peer, sink: ChunkSink) -> None:
        self.peer = peer
        self.sink = sink

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        self.sink.write(piece)
        self.peer.heard_at = time.monotonic()


class Fetcher:
    """Downloads blobs into a :class:`BlobStore`. One instance per node; ``fetch`` may run concurrently
    for different blobs."""

    def __init__(self, store: BlobStore, sources: Sequence[ChunkSource], find_providers: FindProviders,
                 *, self_peer_id: str = "", penalise: Penalise | None = None,
                 is_banned: Callable[[str], bool] | None = None, per_provider: int = PER_PROVIDER,
                 max_inflight: int = MAX_INFLIGHT, find_timeout: float = FIND_TIMEOUT_S,
                 protect: Penalise | None = None, unprotect: Penalise | None = None) -> None:
        self.store = store
        # (peer, tag): the swarm's connection manager keeps providers connected while we download.
        self._protect = protect or (lambda peer, tag: None)
        self._unprotect = unprotect or (lambda peer, tag: None)
        self.sources = list(sources)
        self._find = find_providers
        self._self = self_peer_id
        self._penalise = penalise or (lambda peer, reason: None)
        self._is_banned = is_banned or (lambda peer: False)
        self.per_provider = per_provider
        self.max_inflight = max_inflight
        self.find_timeout = find_timeout

    def _source_for(self, provider: Provider) -> ChunkSource | None:
        for s in self.sources:
            try:
                if s.accepts(provider):
                    return s
            except Exception as exc:  # the edge of one provider: its record is unusable, not the fetch
                log.warning("provider %s has an unusable record: %r", provider.peer_id, exc)
                return None
        return None

    async def _providers(self, cid: str, stats: FetchStats) -> list[_Peer]:
        try:
            found = await self._find(cid)
        except IntellectNodeError as exc:  # a failed lookup is one empty round, not the end of the fetch
            log.info("provider lookup for %s failed: %s", cid, exc)
            stats.lookups.append(f"lookup failed: {exc}")
            return []
        seen: set[str] = set()
        out: list[_Peer] = []
        skipped = 0
        for p in found:  # DHT answers can repeat a provider
            if p.peer_id in seen or p.peer_id == self._self:
                continue
            seen.add(p.peer_id)
            src = self._source_for(p)
            if p.peer_id in stats.bad or self._is_banned(p.peer_id) or src is None:
                skipped += 1
                continue
            out.append(_Peer(p, src))
        note = f"{len(out)} provider(s)"
        if skipped:
            note += f", {skipped} skipped (banned, dropped as bad, or no usable address)"
        stats.lookups.append(note)
        return out

    async def get_manifest(self, cid: str, peers: list[_Peer], stats: FetchStats, *,
                           vet: Callable[[Manifest], None] | None = None,
                           max_bytes: int | None = None) -> Manifest:
        """The blob's manifest from the store, else from the first provider that serves a valid one.
        ``vet(manifest)`` runs before a fetched manifest is stored and may refuse it (raise): a refused
        manifest is neither written nor kept in memory."""
        held = self.store.manifest(cid)
        if held is not None:
            return held
        errors: list[str] = []
        for peer in peers:
            try:
                raw = await peer.source.get_manifest(peer.provider, cid)
                if max_bytes is not None and len(raw) > max_bytes and cid_of(raw) == cid:
                    oversize = len(raw)  # the right bytes, more than the announced size can need
                else:
                    oversize = 0
                    m = open_manifest(raw, cid)
            except ProtocolError as exc:
                self._bad(peer, f"bad manifest: {exc}", stats)
                errors.append(f"{peer.provider.peer_id}: {exc}")
                continue
            except TransportError as exc:
                errors.append(f"{peer.provider.peer_id}: {exc}")
                continue
            except Exception as exc:  # the edge of one provider: whatever it did, it is a failed source
                log.warning("manifest %s from %s failed: %r", cid, peer.provider.peer_id, exc)
                errors.append(f"{peer.provider.peer_id}: {exc!r}")
                continue
            if oversize:  # refused undecoded, whoever serves it: the blob is not what was announced
                raise IntegrityError(f"manifest of blob {cid} takes {oversize} bytes, more than the "
                                     f"{max_bytes} its announced size allows")
            if vet is not None:
                vet(m)
            return self.store.put_manifest(cid, raw)
        raise TransportError(f"no provider served manifest {cid}: " + ("; ".join(errors) or "no providers"))

    def _bad(self, peer: _Peer, reason: str, stats: FetchStats) -> None:
        peer.dropped = True
        stats.bad[peer.provider.peer_id] = reason
        log.warning("dropping provider %s: %s", peer.provider.peer_id, reason)
        self._penalise(peer.provider.peer_id, reason)

    async def fetch(self, cid: str, *, on_progress: Callable[[Progress], None] | None = None,
                    on_manifest: Callable[[Manifest], None] | None = None,
                    budget: Budget | None = None) -> FetchStats:
        """Fetch blob ``cid`` completely into the store. Raises TransportError when no provider can
        supply the remaining chunks after :data:`REDISCOVER_ROUNDS` lookups (and, while no manifest has
        arrived, not before :data:`FIND_TIMEOUT_S`); the error says what each lookup found.

        ``budget`` (see :class:`Budget`) is checked on a fetched manifest before it is stored: a refused
        one leaves nothing behind. ``on_manifest`` runs once it is stored and may raise to refuse the
        blob. A fetch that fails after it stored the manifest itself removes it again when no chunk of
        the blob is held, and with a budget removes the chunks it brought too."""
        t0 = time.monotonic()
        stats = FetchStats()

        def vet(m: Manifest) -> None:
            if budget is not None:
                budget.check(cid, m)

        def got_manifest(m: Manifest) -> None:
            stats.chunks_resumed = len(m.chunks) - len(self.store.missing(cid))
            if on_manifest is not None:
                on_manifest(m)

        m = self.store.manifest(cid)
        if m is not None:
            vet(m)
            got_manifest(m)
        fetching = self.store.fetching
        fetching[cid] = fetching.get(cid, 0) + 1
        try:
            return await self._fetch(cid, m, stats, t0, vet, got_manifest, on_progress,
                                     None if budget is None else budget.max_manifest_bytes())
        except BaseException:
            if m is None and fetching[cid] == 1:  # the manifest (if any) came with this fetch alone
                self._drop_failed(cid, stats, whole=budget is not None)
            raise
        finally:
            if (left := fetching[cid] - 1) > 0:
                fetching[cid] = left
            else:
                del fetching[cid]

    def _drop_failed(self, cid: str, stats: FetchStats, *, whole: bool) -> None:
        """Remove what a failed fetch stored: the manifest when no chunk of the blob is held, or with
        ``whole`` (a blob fetched under a budget: an unproven peer's) the manifest and the chunks this
        fetch brought. A dead or hostile provider's blob then leaves no file behind to reload at the
        next start."""
        m = self.store.manifest(cid)
        if m is None:
            return
        if whole or len(self.store.missing(cid)) == len(m.chunks):
            try:
                self.store.forget_blob(cid, stats.new_chunks if whole else set())
            except OSError as exc:
                log.warning("could not remove the manifest of failed fetch %s: %s", cid, exc)

    async def _fetch(self, cid: str, m: Manifest | None, stats: FetchStats, t0: float,
                     vet: Callable[[Manifest], None], got_manifest: Callable[[Manifest], None],
                     on_progress: Callable[[Progress], None] | None, max_bytes: int | None) -> FetchStats:
        round_ = 0
        answered = False  # some lookup found a provider
        while True:
            if m is not None and not self.store.missing(cid):
                break
            # Until a manifest arrived, time bounds the search too (records still spreading, see above).
            if round_ >= REDISCOVER_ROUNDS and (m is not None or time.monotonic() - t0 >= self.find_timeout):
                break
            if round_:
                await asyncio.sleep(min(2.0, 0.25 * 2 ** round_))  # back off between lookups
            round_ += 1
            peers = await self._providers(cid, stats)
            answered = answered or bool(peers)
            if m is None:
                try:
                    m = await self.get_manifest(cid, peers, stats, vet=vet, max_bytes=max_bytes)
                except TransportError as exc:
                    log.info("manifest %s: %s", cid, exc)
                    if peers:
                        stats.lookups[-1] += f"; manifest: {exc}"
                    continue
                got_manifest(m)
            if peers:
                tag = f"blob-fetch:{cid}:{id(stats)}"  # one per fetch: two fetches hold independently
                for p in peers:
                    self._protect(p.provider.peer_id, tag)
                try:
                    await _Download(self, cid, m, peers, stats, on_progress).run()
                finally:
                    for p in peers:
                        self._unprotect(p.provider.peer_id, tag)
        if m is None or self.store.missing(cid):
            elapsed = time.monotonic() - t0
            if m is None:
                found = "no provider found" if not answered else "no provider served its manifest"
                raise TransportError(
                    f"could not fetch blob {cid}: {found} in {round_} DHT lookups over {elapsed:.0f} s "
                    f"({_summary(stats.lookups)}); is a node that holds it online and connected to this "
                    "swarm?")
            raise TransportError(f"could not complete blob {cid}: providers exhausted after {round_} lookups "
                                 f"({_summary(stats.lookups)}; transport failures {stats.failures}, "
                                 f"dropped as bad {stats.bad})")
        stats.seconds = time.monotonic() - t0
        return stats


def _summary(lookups: list[str]) -> str:
    """The distinct outcomes of the lookups, in order, with counts: short enough for one error line."""
    counts: dict[str, int] = {}
    for note in lookups:
        counts[note] = counts.get(note, 0) + 1
    return "; ".join(f"{n}x {note}" if n > 1 else note for note, n in counts.items()) or "no lookup"


class _Download:
    """One pass over the current providers; ends when the blob is complete or no provider can help."""

    def __init__(self, fetcher: Fetcher, cid: str, manifest: Manifest, peers: list[_Peer],
                 stats: FetchStats, on_progress: Callable[[Progress], None] | None) -> None:
        self.f = fetcher
        self.cid = cid
        self.m = manifest
        self.peers = peers
        self.stats = stats
        self.on_progress = on_progress
        self.store = fetcher.store
        missing = self.store.missing(cid)
        random.shuffle(missing)
        self.todo: list[int] = missing  # chunks not done and not in flight, in preference order
        self.inflight: dict[int, dict[str, asyncio.Task[bool]]] = {}  # chunk -> provider -> request
        self.started: dict[int, float] = {}  # chunk -> when its first request started
        self.done: set[int] = set()
        self.done_chunks = len(manifest.chunks) - len(missing)
        self.done_bytes = manifest.total_size - sum(manifest.chunk_length(i) for i in missing)
        self.last_progress = time.monotonic()
        self.slots = asyncio.Semaphore(fetcher.max_inflight)
        self.changed = asyncio.Event()
        self._avail: list[int] | None = None  # chunk -> live providers holding it; None: recount
        self._partial: list[int] = []  # chunk -> live partial holders holding it (with _avail)
        self._seed_free: bool | None = None  # None: ask _seed_has_nothing_unique again
        self.chunk_seconds = 0.0  # summed duration of the chunk requests that delivered
        self.chunks_timed = 0

    def _availability(self) -> list[int]:
        """How many live providers hold each chunk (recounted after any bitmap or provider change)."""
        if self._avail is None:
            n = len(self.m.chunks)
            seeds = 0
            partial = np.zeros(n, dtype=np.int32)
            for p in self.peers:
                if p.dropped:
                    continue
                if p.complete:
                    seeds += 1
                elif p.have is not None:
                    bits = np.unpackbits(np.frombuffer(p.have.bitmap, dtype=np.uint8), bitorder="little")
                    partial += bits[:n]
            self._partial = partial.tolist()
            self._avail = (partial + seeds).tolist()
        return self._avail

    def _seed_has_nothing_unique(self) -> bool:
        """Every chunk this fetch still needs is held by some live partial holder: a seed has nothing
        left that only it can give, so sparing it would only leave its uplink idle while the last
        chunks crawl from one partial holder to the rest (bench/README.md, "broadcast": the origin idle
        for the last 5 s of a 28 s run). From here the seed is asked like anyone else."""
        if self._seed_free is None:
            partial = self._availability() and self._partial
            self._seed_free = all(partial[i] > 0 for i in self.todo) and all(
                partial[i] > 0 for i in self.inflight)
        return self._seed_free

    def _finished(self) -> bool:
        return not self.todo and not self.inflight

    def _notify(self) -> None:
        self._avail = None
        self._seed_free = None
        self.changed.set()
        self.changed = asyncio.Event()

    def _useful(self, peer: _Peer, i: int) -> bool:
        if i in peer.failed_chunks:
            return False
        return peer.complete or (peer.have is not None and peer.have.has(i))

    def _spared(self, peer: _Peer, i: int) -> bool:
        """Leave chunk ``i`` to a partial holder with a free slot rather than take it from a seed."""
        if not peer.complete or self._seed_has_nothing_unique():
            return False
        fresh = time.monotonic() - SPARE_FRESH_S
        return any(q is not peer and not q.dropped and not q.complete and q.heard_at >= fresh
                   and self._useful(q, i) for q in self.peers)

    def _knows_partial_holders(self) -> bool:
        """Some live provider of this fetch is not a seed: a chunk a seed sends elsewhere can come from
        it later. Without one (the DHT named only the publisher, as for a policy just announced), a
        busy answer would only make fetchers queue for the seed one after another: 1.2 s and 2.4 s
        for the second and third of three fetchers of a small policy delta (bench/README.md,
        "learning")."""
        return any(not q.complete and not q.dropped for q in self.peers)

    def _seed_limited(self, peer: _Peer) -> bool:
        """A seed already has SEED_REQUESTS of ours while partial holders could take part."""
        return peer.complete and peer.busy >= SEED_REQUESTS and self._knows_partial_holders() \
            and not self._seed_has_nothing_unique()

    def _pick(self, peer: _Peer) -> int | None:
        """The rarest chunk this provider can give (first in the random order among equals)."""
        now = time.monotonic()
        if self._seed_limited(peer):
            return None
        avail = self._availability()
        best = -1
        for pos, i in enumerate(self.todo):
            if (best < 0 or avail[i] < avail[self.todo[best]]) and self._useful(peer, i) \
                    and peer.busy_until.get(i, 0.0) <= now and not self._spared(peer, i):
                best = pos
                if avail[i] <= 1:
                    break  # held by this provider alone: nothing is rarer
        if best < 0:
            return None
        return self.todo.pop(best)

    def _hopeless(self) -> bool:
        """True when nothing left to fetch can come from any live provider (even after a refresh)."""
        live = [p for p in self.peers if not p.dropped]
        if not live:
            return True
        if self.inflight:
            return False
        if time.monotonic() - self.last_progress > STALL_S:
            return True
        # Partial holders might still gain chunks; a complete holder that failed a chunk will not.
        return all(p.complete and all(i in p.failed_chunks for i in self.todo) for p in live)

    async def _refresh_have(self, peer: _Peer) -> bool:
        """Ask for the peer's bitmap; True when the provider holds such requests open until it has
        something new (it answered with its store's version): then the next one can follow at once."""
        peer.have_at = time.monotonic()
        long_poll = getattr(peer.source, "get_have_after", None)
        try:
            if long_poll is not None:
                raw, version = await long_poll(peer.provider, self.cid, peer.have_version, HAVE_WAIT_S)
            else:
                raw, version = await peer.source.get_have(peer.provider, self.cid), None
            have = decode_have(raw, self.cid, len(self.m.chunks))
        except ChunkUnavailable:  # it does not know the manifest (yet)
            peer.have_version = None
            return False
        except TransportError as exc:
            peer.have_version = None
            self._failure(peer, None, exc)
            return False
        except ProtocolError as exc:
            self.f._bad(peer, f"bad have bitmap: {exc}", self.stats)
            self._notify()
            return False
        except Exception as exc:  # the edge of one provider: a failed source, never the fetch's end
            log.warning("bitmap of %s from %s failed: %r", self.cid, peer.provider.peer_id, exc)
            peer.have_version = None
            self._failure(peer, None, TransportError(repr(exc)))
            return False
        peer.have_version = version
        peer.have = have
        peer.heard_at = time.monotonic()
        peer.complete = have.held() == len(self.m.chunks)
        self._notify()
        return version is not None

    def _failure(self, peer: _Peer, index: int | None, exc: Exception) -> None:
        pid = peer.provider.peer_id
        self.stats.failures[pid] = self.stats.failures.get(pid, 0) + 1
        if index is not None:
            peer.failed_chunks.add(index)
        if not isinstance(exc, ChunkUnavailable):
            peer.consecutive_failures += 1
            if peer.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                peer.dropped = True
                log.info("provider %s dropped after %d failures: %s", pid, peer.consecutive_failures, exc)
        elif index is not None and peer.have is not None:
            peer.complete = False  # its bitmap was stale; re-ask before trusting it again

    def _pick_endgame(self, peer: _Peer) -> int | None:
        """Nothing left to start: duplicate a chunk that has been in flight elsewhere for a while."""
        now = time.monotonic()
        if self.todo or self._seed_limited(peer):
            return None
        pid = peer.provider.peer_id
        late = max(ENDGAME_AFTER_S, 2 * self.chunk_seconds / self.chunks_timed) if self.chunks_timed \
            else ENDGAME_AFTER_S
        for i, holders in self.inflight.items():
            if (len(holders) == 1 and pid not in holders and i not in self.done and self._useful(peer, i)
                    and now - self.started[i] >= late and not self._spared(peer, i)):
                return i
        return None

    async def _worker(self, peer: _Peer) -> None:
        pid = peer.provider.peer_id
        while not self._finished() and not peer.dropped:
            if self._hopeless():
                return
            async with self.slots:
                i = self._pick(peer)
                if i is None and (i := self._pick_endgame(peer)) is not None:
                    self.stats.endgame_requests += 1
                if i is not None:
                    # Its own task, so the provider that delivers first can cancel this one.
                    task = asyncio.ensure_future(self._fetch_one(peer, i))
                    self.inflight.setdefault(i, {})[pid] = task
                    self.started.setdefault(i, time.monotonic())
                    peer.busy += 1
                    try:
                        ok = await task
                    except asyncio.CancelledError:
                        me = asyncio.current_task()
                        if not task.cancelled() or (me is not None and me.cancelling()):
                            raise
                        ok = True  # another provider delivered this chunk first
                    finally:
                        peer.busy -= 1
                        holders = self.inflight.get(i, {})
                        holders.pop(pid, None)
                        if not holders:
                            self.inflight.pop(i, None)
                            self.started.pop(i, None)
                    if not ok and i not in self.inflight and i not in self.done:
                        self.todo.insert(0, i)  # retry it first, elsewhere
                    self._notify()
                    continue
            waiter = self.changed
            try:
                await asyncio.wait_for(waiter.wait(), timeout=HAVE_REFRESH_S)
            except TimeoutError:
                pass

    async def _fetch_one(self, peer: _Peer, i: int) -> bool:
        chunk = self.m.chunks[i]
        n = self.m.chunk_length(i)
        if i in self.done:  # an end-game copy that lost the race before it started
            return True
        if self.store.has_chunk(chunk):  # same content at another index, or another fetch got it
            self.done.add(i)
            self._commit_progress(peer, i, n, fetched=False)
            return True
        writer = self.store.open_chunk_writer(chunk, n)
        t0 = time.monotonic()
        try:
            # Only a seed that still holds chunks nobody else has is asked "if idle" (paced, each chunk
            # once), and only while this fetch knows a partial holder to take the chunk from instead. A
            # partial holder sends what it holds to everyone who asks (refusing made peers wait for
            # each other), and so does a seed with nothing unique left (its uplink is free).
            sink = _Heard(peer, writer)
            source = peer.source
            if isinstance(source, IdleAwareSource) and source.speaks_if_idle:
                if_idle = peer.complete and self._knows_partial_holders() \
                    and not self._seed_has_nothing_unique()
                await source.read_chunk(peer.provider, chunk, n, sink, if_idle=if_idle)
            else:
                await peer.source.read_chunk(peer.provider, chunk, n, sink)
            writer.commit()
        except (IntegrityError, ProtocolError) as exc:
            writer.abort()
            self.f._bad(peer, f"chunk {i}: {exc}", self.stats)
            return False
        except ChunkBusy:  # it is sending this chunk to another peer: take another, ask again later
            writer.abort()
            peer.busy_until[i] = time.monotonic() + BUSY_RETRY_S
            self.stats.busy_answers += 1
            return False
        except TransportError as exc:
            writer.abort()
            self._failure(peer, i, exc)
            return False
        except Exception as exc:  # the edge of one provider: a failed source, never the fetch's end
            writer.abort()
            log.warning("chunk %d of %s from %s failed: %r", i, self.cid, peer.provider.peer_id, exc)
            self._failure(peer, i, TransportError(repr(exc)))
            return False
        except BaseException:
            writer.abort()
            raise
        self.done.add(i)
        self.chunk_seconds += time.monotonic() - t0
        self.chunks_timed += 1
        me = asyncio.current_task()
        for other in self.inflight.get(i, {}).values():
            if other is not me:
                other.cancel()  # an end-game duplicate still on its way: not needed any more
        self.last_progress = time.monotonic()
        peer.consecutive_failures = 0
        self.stats.chunks_fetched += 1
        self.stats.bytes_fetched += n
        self.stats.new_chunks.add(chunk)
        pid = peer.provider.peer_id
        self.stats.by_provider[pid] = self.stats.by_provider.get(pid, 0) + 1
        self._commit_progress(peer, i, n, fetched=True, seconds=time.monotonic() - t0)
        return True

    def _commit_progress(self, peer: _Peer, i: int, n: int, *, fetched: bool, seconds: float = 0.0) -> None:
        self.done_chunks += 1
        self.done_bytes += n
        if self.on_progress is not None:
            self.on_progress(Progress(self.cid, i, n, peer.provider.peer_id if fetched else "",
                                      self.done_chunks, len(self.m.chunks), self.done_bytes,
                                      self.m.total_size, seconds))

    async def _refresher(self, peer: _Peer) -> None:
        """Keep a partial holder's bitmap fresh, whether or not our requests to it are busy: a stale
        view of what peers hold sends requests to the origin for chunks a peer already has. A provider
        that holds the request open until it commits a chunk (``/have?after=``) is asked again as soon
        as it answers: its new chunks are known here a round trip after they land, not up to a poll
        period later (which on a fast link cost more than the transfer). Others are polled every
        HAVE_REFRESH_S."""
        while not peer.dropped:
            asked = time.monotonic()
            if not peer.complete and await self._refresh_have(peer):
                # It answered because something changed (or after HAVE_WAIT_S): ask again, but not
                # more often than HAVE_MIN_INTERVAL_S.
                if (left := HAVE_MIN_INTERVAL_S - (time.monotonic() - asked)) > 0:
                    await asyncio.sleep(left)
                continue
            await asyncio.sleep(HAVE_REFRESH_S)  # a poll period, not a wait for a condition

    async def run(self) -> None:
        if self._finished():
            return
        refreshers: list[asyncio.Future[None]] = [asyncio.ensure_future(self._refresher(p))
                                                  for p in self.peers]
        discoverer: asyncio.Future[None] | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                for peer in self.peers:
                    for _ in range(self.f.per_provider):
                        tg.create_task(self._worker(peer))
                discoverer = asyncio.ensure_future(self._discover(tg, refreshers))
        finally:
            if discoverer is not None:
                discoverer.cancel()
                refreshers.append(discoverer)
            for r in refreshers:
                r.cancel()
            for res in await asyncio.gather(*refreshers, return_exceptions=True):
                if isinstance(res, Exception):
                    log.warning("bitmap refresher or provider search of %s failed: %r", self.cid, res)

    async def _discover(self, tg: asyncio.TaskGroup, refreshers: list[asyncio.Future[None]]) -> None:
        """Look for providers again while this pass knows no partial holder (REDISCOVER_DURING_S), and
        put the new ones to work in this pass."""
        delay = REDISCOVER_DURING_S
        while True:
            await asyncio.sleep(delay)  # a search interval, not a wait for a condition
            delay = min(2 * delay, REDISCOVER_DURING_MAX_S)
            if self._finished():
                return
            if self._knows_partial_holders():
                continue
            known = {p.provider.peer_id for p in self.peers}
            found = await self.f._providers(self.cid, self.stats)
            new = [p for p in found if p.provider.peer_id not in known]
            if not new or self._finished():
                continue
            try:
                for p in new:
                    for _ in range(self.f.per_provider):
                        tg.create_task(self._worker(p))
            except RuntimeError:  # the pass ended while we looked
                return
            for p in new:
                self.peers.append(p)
                refreshers.append(asyncio.ensure_future(self._refresher(p)))
            log.info("fetch of %s: %d more provider(s) found during the download", self.cid, len(new))
            self._notify()
