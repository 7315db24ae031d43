"""Policy distribution: the trainer publishes each version as a delta (and every K versions in full);
workers obtain a version by the cheapest path that ends with the announced content hash.

Publisher (trainer role)::

    pub = PolicyPublisher(data_dir / "policy", blobs, key, run_id, full_every=8)
    ann, raw = await pub.publish(version, state_dict_or_checkpoint)
    await swarm.publish(topic(run_id, "policy"), raw)

For version v it writes the canonical checkpoint atomically, encodes the delta from v-1
(:func:`intellect_node.policy.delta.encode_delta`) and puts it in the blob store, puts the full
checkpoint in the blob store when v is an anchor (the first version, or K versions after the last
anchor), persists its chain state and only then returns the signed announcement.

Follower (worker / validator roles)::

    fol = PolicyFollower(data_dir / "policy", blobs, run_id=..., trainer=..., max_checkpoint_bytes=...)
    swarm.subscribe(topic(run_id, "policy"), announcement_validator(run_id, trainer), on_announcement)
    result = await fol.obtain(ann)         # result.checkpoint, result.path ("delta" | "full" | ...)

It walks the announced delta chain from the version it holds when that version's hash is on the chain;
otherwise (further behind, a diverged copy) or when a delta fails (malformed, wrong base, result hash
differs) it fetches the latest full checkpoint and walks the chain from there. A version is used only
after its bytes hash to the announced hash, whichever path produced them; it is persisted (checkpoint
file, then the ``CURRENT`` pointer, both atomic) before ``obtain`` returns.

Version 0 from the model folder: a fresh trainer publishes, as version 0, the run's model as it loaded
it (fp32, the trainer's tensor names), and every worker and validator holds that model folder already.
Given ``base`` (a function writing that file from the local folder, ``trainer.model.initial_policy``),
a follower that holds no version builds it in a worker thread as soon as it hears a chain that starts
at version 0 (not before: a node joining a run further on never needs it, and for a large model it is
the whole model written to disk) and, when its hash is the announced one, walks the chain from it
instead of fetching the full checkpoint (path ``"local"``). Any other hash (another model, another
dtype) or a chain whose anchor is later fetches as before; the hash check is the same either way.

Shortcuts: old versions' chunks stay in the blob store until ``intellect-node blob gc`` removes the
blobs no longer pinned (``commands/blob_store.py``); a delta
chain that fails from the full checkpoint too leaves the node on its old version until the next
announcement (the next anchor at the latest) instead of asking the trainer for an extra full copy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Protocol

import torch

from intellect_node.blobs.fetch import FetchStats
from intellect_node.blobs.service import BlobService
from intellect_node.blobs.store import BlobStore
from intellect_node.config.status import StatusBoard
from intellect_node.errors import (
    ConfigError,
    IntegrityError,
    IntellectNodeError,
    ProtocolError,
)
from intellect_node.fsutil import atomic_write_text
from intellect_node.policy.delta import (
    ALL_DENSE_KINDS,
    DENSE_KINDS,
    ZSTD_LEVEL,
    KindMemo,
    apply_delta,
    delta_size_limit,
    encode_delta,
)
from intellect_node.policy.weights import PolicyWeights, require_finite
from intellect_node.protocol.blob import (
    DEFAULT_CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MIN_CHUNK_SIZE,
    Manifest,
)
from intellect_node.protocol.policy import (
    MAX_CHAIN,
    POLICY_DTYPES,
    DeltaLink,
    PolicyAnnouncement,
    seal_announcement,
)
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.pins import PUBLISHER_STATE

log = logging.getLogger(__name__)

CURRENT = "CURRENT"
BASE_FILE = "base-v0.safetensors"
"""Version 0 as built from the local model folder, until it is held (or found to differ)."""
FOLLOW_RETRIES = 3
DEFAULT_FULL_EVERY = 8
"""K: a full checkpoint every 8 versions. A worker that missed up to 7 updates catches up by deltas
alone; a late joiner fetches one full checkpoint plus at most 7 deltas (each a fraction of it)."""


def _ckpt_name(version: int) -> str:
    return f"v{version:010d}.safetensors"


def _policy_dtype(ckpt: PolicyWeights) -> str:
    """The floating-point dtype holding most bytes (what the run config's ``dtype`` refers to)."""
    by: dict[str, int] = {}
    for info in ckpt.tensors.values():
        if info.dtype in POLICY_DTYPES:
            by[info.dtype] = by.get(info.dtype, 0) + info.nbytes
    if not by:
        raise ConfigError("the policy has no F32, BF16 or F16 tensors to publish", field="dtype")
    return max(by, key=lambda k: by[k])


_STATE_ERRORS = (OSError, ValueError, KeyError, TypeError, ProtocolError, IntegrityError)
"""What :func:`_load_named` raises for a state file or checkpoint that cannot be used."""


def _load_named(root: Path, state_file: str, max_size: int) -> tuple[dict[str, Any], PolicyWeights]:
    """``(state, checkpoint)``: the JSON state file ``root/state_file`` (``publisher.json``, ``CURRENT``)
    and the checkpoint of the version it names, checked against the hash it records; one of
    :data:`_STATE_ERRORS` when either is unusable."""
    st = json.loads((root / state_file).read_text())
    if not isinstance(st, dict):
        raise ValueError(f"{state_file} is not a JSON object")
    ckpt = PolicyWeights.load(root / _ckpt_name(int(st["version"])), max_size=max_size)
    if ckpt.content_hash != st["hash"]:
        raise IntegrityError(f"checkpoint file does not match {state_file}")
    return st, ckpt


def _write_unsynced(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write a file atomically (a temporary name, then a rename) but without fsync.

    For files that are caches of content-addressed data, checked against a hash when read back: a policy
    version held (``CURRENT`` names its hash) and the publisher's last version (``publisher.json``), and
    a delta on its way into the blob store. After an OS crash a torn file fails that check and the node
    fetches the version again (follower) or publishes the next one in full (publisher). An fsync of a
    model-sized file took tens to hundreds of milliseconds on the loaded test machine, on the path of
    every new version."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _Clock:
    """Laps of one publication or fetch (``timings``: where a version's time goes, in metrics)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._t
        self._t = now


# ============================================================================================ publisher
class PolicyPublisher:
    """The trainer's side. One per run; ``publish`` calls are serialised."""

    def __init__(self, root: str | os.PathLike[str], blobs: BlobService, key: SigningKey, run_id: str, *,
                 full_every: int = DEFAULT_FULL_EVERY, zstd_level: int = ZSTD_LEVEL,
                 dense_kinds: tuple[str, ...] = DENSE_KINDS, board: StatusBoard | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, announce_min_chunks: int = 0) -> None:
        """``announce_min_chunks``: a delta of fewer chunks gets no DHT provider record (the roles'
        followers fetch with the announcement's signer as the holder, ``roles/common.HintedFetcher``);
        full checkpoints are always announced."""
        self.announce_min_chunks = announce_min_chunks
        if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"chunk_size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes; got "
                              f"{chunk_size}", field="policy_chunk_mib")
        self.chunk_size = chunk_size
        if not 1 <= full_every <= MAX_CHAIN:
            raise ConfigError(f"full_every must be in [1, {MAX_CHAIN}] (an announcement carries at most "
                              f"{MAX_CHAIN} delta links); got {full_every}", field="full_every")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.blobs = blobs
        self.key = key
        self.run_id = run_id
        self.full_every = full_every
        if not dense_kinds or not set(dense_kinds) <= set(ALL_DENSE_KINDS):
            raise ConfigError(f"dense_kinds must be a non-empty subset of {ALL_DENSE_KINDS}; "
                              f"got {dense_kinds}", field="dense_kinds")
        self.zstd_level = zstd_level
        self.dense_kinds = tuple(dense_kinds)
        self._board = board
        self._lock = asyncio.Lock()
        self._prev: PolicyWeights | None = None
        self._version: int | None = None
        self._full: tuple[int, str, int] | None = None  # (version, blob cid, size)
        self._links: list[DeltaLink] = []
        self._kinds = KindMemo()  # each tensor's winning dense encoding (policy/delta.py)
        self.timings: dict[str, float] = {}
        """Where the last publication's time went (seconds): save, delta, full, state."""
        self._load_state()

    @property
    def version(self) -> int | None:
        return self._version

    def _load_state(self) -> None:
        """Resume the chain after a restart from ``publisher.json`` and the last checkpoint file."""
        path = self.root / PUBLISHER_STATE
        if not path.exists():
            return
        try:
            st, ckpt = _load_named(self.root, PUBLISHER_STATE, 1 << 62)
            links = [DeltaLink(**d) for d in st["links"]]
            full = (int(st["full"][0]), str(st["full"][1]), int(st["full"][2]))
        except _STATE_ERRORS as exc:
            # Publishing still works: the next version becomes a fresh anchor.
            log.warning("policy publisher state in %s unusable (%s); next version is published in full",
                        self.root, exc)
            return
        self._prev, self._version, self._full, self._links = ckpt, int(st["version"]), full, links

    def announcement(self) -> tuple[PolicyAnnouncement, bytes] | None:
        """The newest published version's announcement and its signed bytes (None before the first).

        Rebuilt from the chain state, so a publisher reopened after a restart has it too: the trainer
        re-announces its newest version without keeping the bytes itself. Signing is deterministic, so
        these are the bytes :meth:`publish` returned for that version."""
        if self._version is None or self._prev is None or self._full is None:
            return None
        return self._announce(self._version, self._prev, self._full, self._links)

    def _chunk_size_for(self, path: Path) -> int:
        """The configured chunk size, doubled until the file fits in MAX_CHUNKS chunks."""
        size, chunk = path.stat().st_size, self.chunk_size
        while -(-size // chunk) > MAX_CHUNKS and chunk < MAX_CHUNK_SIZE:
            chunk *= 2
        if chunk != self.chunk_size:
            log.info("publishing %s in %g MiB chunks (%d bytes need more than %d chunks of the configured "
                     "%g MiB)", path.name, chunk / (1 << 20), size, MAX_CHUNKS, self.chunk_size / (1 << 20))
        return min(chunk, MAX_CHUNK_SIZE)

    def _announce(self, version: int, ckpt: PolicyWeights, full: tuple[int, str, int],
                  links: list[DeltaLink]) -> tuple[PolicyAnnouncement, bytes]:
        ann = PolicyAnnouncement(run_id=self.run_id, version=version, dtype=_policy_dtype(ckpt),
                                 checkpoint_hash=ckpt.content_hash, checkpoint_size=ckpt.nbytes,
                                 full_version=full[0], full_cid=full[1], full_size=full[2],
                                 deltas=list(links))
        return ann, seal_announcement(self.key, ann)

    async def publish(self, version: int, policy: PolicyWeights | Mapping[str, torch.Tensor], *,
                      force_full: bool = False) -> tuple[PolicyAnnouncement, bytes]:
        """Persist and publish ``version``; return the announcement and its signed envelope bytes.
        IntegrityError, before anything is written, when a tensor is not finite."""
        await asyncio.to_thread(require_finite,
                                policy.to_state_dict() if isinstance(policy, PolicyWeights) else policy)
        async with self._lock:
            clock = _Clock()
            if self._version is not None and version <= self._version:
                raise ValueError(f"policy version {version} is not after the last published {self._version}")
            path = self.root / _ckpt_name(version)
            if isinstance(policy, PolicyWeights):
                await asyncio.to_thread(_write_unsynced, path, policy.to_bytes())
                # Kept mapped from the file, not as the caller's bytes (the trainer's copy of its weights),
                # so the publisher holds no model-sized buffer between versions.
                ckpt = await asyncio.to_thread(PolicyWeights.load, path, max_size=1 << 62)
            else:  # streamed to the file tensor by tensor and mapped back: no in-memory copy of the model
                ckpt = await asyncio.to_thread(PolicyWeights.write, path, policy)
            clock.lap("save_s")
            prev = self._prev if self._version == version - 1 else None
            links = list(self._links) if prev is not None else []
            if prev is not None:
                delta = await asyncio.to_thread(encode_delta, prev, ckpt, level=self.zstd_level,
                                                dense=self.dense_kinds, memo=self._kinds)
                delta_path = self.root / f"v{version:010d}.delta"
                await asyncio.to_thread(_write_unsynced, delta_path, delta)
                delta_cid, _ = await self.blobs.put_file(delta_path, name=f"{self.run_id}-v{version}.delta",
                                                         chunk_size=self._chunk_size_for(delta_path),
                                                         announce_min_chunks=self.announce_min_chunks)
                delta_path.unlink()  # the blob store holds it now
                clock.lap("delta_s")
                links.append(DeltaLink(version=version, base_hash=prev.content_hash,
                                       target_hash=ckpt.content_hash, delta_cid=delta_cid,
                                       delta_size=len(delta)))
            full = self._full
            if prev is None or force_full or full is None or version - full[0] >= self.full_every:
                full_cid, m = await self.blobs.put_file(path, name=f"{self.run_id}-v{version}.safetensors",
                                                        chunk_size=self._chunk_size_for(path))
                full = (version, full_cid, m.total_size)
                links = links[-1:]  # a full version keeps only the delta from its predecessor
                clock.lap("full_s")
            ann, raw = self._announce(version, ckpt, full, links)
            state = {"version": version, "hash": ckpt.content_hash, "full": list(full),
                     "links": [{f: getattr(link, f) for f in DeltaLink.__struct_fields__} for link in links]}
            await asyncio.to_thread(atomic_write_text, self.root / PUBLISHER_STATE, json.dumps(state))
            clock.lap("state_s")
            self.timings = clock.laps
            old = self._version
            self._prev, self._version, self._full, self._links = ckpt, version, full, links
            if old is not None:  # the blob store keeps what peers may still fetch
                (self.root / _ckpt_name(old)).unlink(missing_ok=True)
            if self._board is not None:
                self._board.set_policy(current=version, local=version)
            return ann, raw


# ============================================================================================ follower
@dataclass
class ObtainResult:
    version: int
    checkpoint: PolicyWeights
    path: str
    """"current" (already held), "delta", "full" (full checkpoint, then any deltas), "local" (version 0
    from the model folder, then any deltas), "stale"."""
    bytes_fetched: int = 0
    deltas_applied: int = 0
    fallback: str = ""  # why the delta path was not taken or failed; empty when it was not needed
    rejected: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent: fetch (manifest and chunks, hash-checked), read (blob to memory), apply (delta
    decode and the result's hash check), persist (the version's file and CURRENT)."""


class PolicyBlobs(Protocol):
    """What the follower uses of a blob service: a ``BlobService``, or one that asks the trainer first
    (``roles.common.fetch.HintedFetcher.holding``)."""

    @property
    def store(self) -> BlobStore: ...

    async def fetch(self, cid: str, *, on_manifest: Callable[[Manifest], None] | None = None) -> FetchStats:
        ...


class PolicyFollower:
    """A worker's side. Holds one version (in memory and on disk); ``obtain`` calls are serialised."""

    def __init__(self, root: str | os.PathLike[str], blobs: PolicyBlobs, *, run_id: str, trainer: str,
                 max_checkpoint_bytes: int, board: StatusBoard | None = None,
                 on_reject: Callable[[str, str], object] | None = None,
                 on_passing: Callable[[int, PolicyWeights], Awaitable[None]] | None = None,
                 keep_passing: int = 0, base: Callable[[Path], PolicyWeights] | None = None) -> None:
        """``on_passing(version, checkpoint)`` is awaited for each version a chain walk passes through on
        its way to the announced one, for the ``keep_passing`` versions just before it (a validator
        judges batches of the last ``async_level`` versions too: without this, a version superseded
        while the follower was busy would never be held, and every batch made on it would be refused).
        Each such checkpoint hashed to the announced ``target_hash`` of its link before it is passed.
        :meth:`follow` then also obtains, oldest first, each version offered within that window before the
        newest (one the walk cannot pass through: the one before an anchor).

        ``base(path)`` writes version 0 as the trainer would publish it from the local model folder and
        returns it (see the module docstring); :meth:`prepare_base` starts it."""
        if max_checkpoint_bytes <= 0:
            raise ConfigError("max_checkpoint_bytes must be positive", field="max_checkpoint_bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.blobs = blobs
        self.run_id = run_id
        self.trainer = trainer
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self._board = board
        self._on_reject = on_reject or (lambda peer, reason: None)
        self._on_passing = on_passing
        self._keep_passing = keep_passing
        self._offered: dict[int, PolicyAnnouncement] = {}
        """With ``keep_passing``: versions offered within the window, obtained in turn (oldest first)
        before the newest. A delta walk cannot pass through a version just before an anchor (the anchor's
        chain starts at it), so those are obtained one by one."""
        self._lock = asyncio.Lock()
        self._pending: PolicyAnnouncement | None = None
        self._wake = asyncio.Event()
        self._clock = _Clock()
        self.last: ObtainResult | None = None
        """The last version obtained (its ``timings`` say where the time went)."""
        self.version: int | None = None
        self.checkpoint: PolicyWeights | None = None
        self._base = base
        self._base_task: asyncio.Future[PolicyWeights] | None = None
        self._load_current()

    @property
    def checkpoint_path(self) -> Path | None:
        """The held version's canonical safetensors file (any safetensors reader loads it)."""
        return None if self.version is None else self.root / _ckpt_name(self.version)

    def _load_current(self) -> None:
        path = self.root / CURRENT
        if not path.exists():
            return
        try:
            cur, ckpt = _load_named(self.root, CURRENT, self.max_checkpoint_bytes)
        except _STATE_ERRORS as exc:
            log.warning("held policy in %s unusable (%s); starting without one", self.root, exc)
            return
        self.version, self.checkpoint = int(cur["version"]), ckpt
        (self.root / BASE_FILE).unlink(missing_ok=True)  # left by a build that a crash interrupted
        if self._board is not None:
            self._board.set_policy(local=self.version)

    async def obtain(self, ann: PolicyAnnouncement) -> ObtainResult:
        """Hold version ``ann.version`` (already verified: see ``protocol.policy.open_announcement``).

        Raises TransportError when the blobs cannot be fetched and IntegrityError when no path produced
        the announced hash; the node then keeps the version it had.
        """
        if ann.run_id != self.run_id:
            raise ProtocolError(f"announcement for run {ann.run_id!r}, this node follows {self.run_id!r}")
        async with self._lock:
            if self._board is not None:
                self._board.set_policy(current=ann.version)
            held, ckpt = self.version, self.checkpoint
            if held is not None and ckpt is not None:
                if held > ann.version:
                    return ObtainResult(held, ckpt, "stale")
                if held == ann.version and ckpt.content_hash == ann.checkpoint_hash:
                    return ObtainResult(held, ckpt, "current")
            clock = _Clock()
            self._clock = clock
            result = await self._by_delta(ann)
            if result.path != "delta":
                base = await self._local_base(ann) if held is None else None
                if base is not None:
                    result = await self._from_base(ann, base, result)
                else:
                    result = await self._by_full(ann, result)
            await asyncio.to_thread(self._persist, result.version, result.checkpoint,
                                    from_base=result.path == "local" and result.version == 0)
            clock.lap("persist_s")
            if self._base_task is not None:  # a version is held: the base is never needed again
                self._drop_base()
            result.timings = clock.laps
            self.last = result
            self.version, self.checkpoint = result.version, result.checkpoint
            if self._board is not None:
                self._board.set_policy(local=result.version)
            return result

    def offer(self, ann: PolicyAnnouncement) -> None:
        """Hand over a (validated) announcement from the gossip handler; :meth:`follow` obtains the newest
        one offered and skips versions superseded while it was busy (with ``keep_passing``, only those
        older than its window). Offering a version again (the trainer's repeats) gets one given up on
        tried again."""
        if self._keep_passing and (self.version is None or ann.version > self.version):
            self._offered.setdefault(ann.version, ann)
            newest = max(self._offered)
            for v in [v for v in self._offered if v < newest - self._keep_passing]:
                del self._offered[v]
        if ann.full_version == 0:  # a chain from version 0: the base may serve, start on it now
            self.prepare_base()
        if self._pending is None or ann.version > self._pending.version:
            self._pending = ann
            self._wake.set()

    def _take_offer(self) -> PolicyAnnouncement | None:
        """The next announcement to obtain: the newest offered, or (with ``keep_passing``) an earlier one
        in its window not held yet, each taken once, while the newest waits its turn."""
        ann, self._pending = self._pending, None
        if ann is None:
            return None
        floor = max(ann.version - self._keep_passing, -1 if self.version is None else self.version + 1)
        earlier = [v for v in sorted(self._offered) if floor <= v < ann.version]
        if earlier:
            self._pending = ann
            self._wake.set()
            ann = self._offered[earlier[0]]
        for v in [v for v in self._offered if v <= ann.version]:
            del self._offered[v]
        return ann

    async def follow(self, on_new: Callable[[ObtainResult], Awaitable[None] | None], *,
                     retries: int = FOLLOW_RETRIES, backoff_s: float = 1.0) -> None:
        """Run until cancelled: obtain each newest offered version and pass the result to ``on_new``.

        A version that cannot be obtained is retried ``retries`` times (``backoff_s`` doubling between
        tries) unless another offer comes meanwhile (the newest offered is taken up then); after that it
        is given up (logged) until the next offer.
        """
        while True:
            await self._wake.wait()
            self._wake.clear()
            ann = self._take_offer()
            if ann is None or (self.version is not None and ann.version <= self.version):
                continue
            for attempt in range(retries + 1):
                try:
                    result = await self.obtain(ann)
                except (IntellectNodeError, OSError) as exc:  # OSError: disk
                    log.warning("policy v%d not obtained (try %d of %d): %s", ann.version, attempt + 1,
                                retries + 1, exc)
                    if attempt == retries or self._pending is not None:
                        break
                    try:  # a newer offer ends the wait early
                        await asyncio.wait_for(self._wake.wait(), timeout=backoff_s * 2 ** attempt)
                    except TimeoutError:
                        pass
                    if self._pending is not None:
                        break
                    continue
                ret = on_new(result)
                if ret is not None:
                    await ret
                break

    async def _by_delta(self, ann: PolicyAnnouncement) -> ObtainResult:
        """Walk the chain from the held version; a result with path "" and ``fallback`` set on failure."""
        out = ObtainResult(ann.version, PolicyWeights(bytearray(), {}), "")
        held, ckpt = self.version, self.checkpoint
        if held is None or ckpt is None:
            out.fallback = "no policy held"
            return out
        try:
            link = ann.link(held + 1)
        except KeyError:
            out.fallback = f"held version {held} is not on the announced chain"
            return out
        if link.base_hash != ckpt.content_hash:
            out.fallback = f"held version {held} differs from the trainer's (hash {ckpt.content_hash})"
            return out
        try:
            out.checkpoint = await self._walk(ann, held, ckpt, out)
        except (ProtocolError, IntegrityError) as exc:
            out.fallback = f"delta failed: {exc}"
            out.rejected.append(out.fallback)
            self._on_reject(self.trainer, out.fallback)
            log.warning("policy v%d: %s; fetching the full checkpoint", ann.version, exc)
            return out
        out.path = "delta"
        return out

    async def _by_full(self, ann: PolicyAnnouncement, out: ObtainResult) -> ObtainResult:
        data = await self._fetch(ann.full_cid, ann.full_size, self.max_checkpoint_bytes, out)
        full = await asyncio.to_thread(PolicyWeights.parse, data, max_size=self.max_checkpoint_bytes)
        if full.content_hash != ann.full_hash:
            raise IntegrityError(f"full checkpoint v{ann.full_version} hashes to {full.content_hash}, "
                                 f"announced {ann.full_hash}")
        self._clock.lap("apply_s")
        if self.version is None or ann.full_version > self.version:
            await self._passing(ann, ann.full_version, full)
        out.checkpoint = await self._walk(ann, ann.full_version, full, out)
        out.path = "full"
        return out

    def prepare_base(self) -> None:
        """Start building version 0 from the model folder (in a worker thread) when this follower holds
        no version and was given ``base``; ``obtain`` uses it if the trainer's version 0 hashes the same."""
        if self._base is None or self._base_task is not None or self.version is not None:
            return
        build, path = self._base, self.root / BASE_FILE

        def run() -> PolicyWeights:
            ckpt = build(path)
            if self._base is not build:  # dropped while it was written
                path.unlink(missing_ok=True)
            return ckpt

        self._base_task = asyncio.ensure_future(asyncio.to_thread(run))
        # Retrieved here too, so a build that fails while nothing awaits it is not reported as lost.
        self._base_task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _local_base(self, ann: PolicyAnnouncement) -> PolicyWeights | None:
        """Version 0 from the model folder when ``ann``'s chain starts at version 0 and it hashes to
        the announced hash; None otherwise (then it is not tried again)."""
        if self._base is None or ann.full_version != 0:
            return None
        self.prepare_base()
        assert self._base_task is not None
        try:
            base = await self._base_task
        except Exception as exc:  # a folder the engine loaded but the trainer's loader refuses, a full disk
            log.warning("version 0 not built from the model folder (%s); fetching it", exc)
            self._drop_base()
            return None
        if base.content_hash != ann.full_hash:
            log.info("the model folder's weights are not the trainer's version 0 (%s, announced %s); "
                     "fetching it", base.content_hash, ann.full_hash)
            self._drop_base()
            return None
        return base

    def _drop_base(self) -> None:
        """Never use the local base again (a version is held, or it differs); its file goes."""
        if self._base_task is not None and not self._base_task.done():
            self._base_task.cancel()  # the thread finishes its write; the file is removed below anyway
        self._base, self._base_task = None, None
        (self.root / BASE_FILE).unlink(missing_ok=True)  # a mapping of it stays valid while used

    async def _from_base(self, ann: PolicyAnnouncement, base: PolicyWeights,
                         out: ObtainResult) -> ObtainResult:
        self._clock.lap("base_s")
        await self._passing(ann, 0, base)
        out.checkpoint = await self._walk(ann, 0, base, out)
        out.path = "local"
        return out

    async def _passing(self, ann: PolicyAnnouncement, version: int, ckpt: PolicyWeights) -> None:
        """Hand a version passed on the way to ``ann.version`` to ``on_passing`` if it is wanted."""
        if self._on_passing is not None and ann.version - self._keep_passing <= version < ann.version:
            await self._on_passing(version, ckpt)

    async def _walk(self, ann: PolicyAnnouncement, version: int, ckpt: PolicyWeights,
                    out: ObtainResult) -> PolicyWeights:
        limit = delta_size_limit(self.max_checkpoint_bytes)
        while version < ann.version:
            link = ann.link(version + 1)
            data = await self._fetch(link.delta_cid, link.delta_size, limit, out)
            ckpt = await asyncio.to_thread(apply_delta, ckpt, data, expected_hash=link.target_hash,
                                           max_size=self.max_checkpoint_bytes)
            self._clock.lap("apply_s")
            version += 1
            out.deltas_applied += 1
            await self._passing(ann, version, ckpt)
        return ckpt

    async def _fetch(self, cid: str, size: int, limit: int, out: ObtainResult) -> bytearray:
        """Fetch blob ``cid`` (which the trainer announced as ``size`` bytes) and return its content."""
        if size > limit:
            raise IntegrityError(f"blob {cid} of {size} bytes is over the limit of {limit}")

        def check(m: Manifest) -> None:  # before any chunk is downloaded
            if m.total_size != size:
                raise IntegrityError(f"blob {cid} holds {m.total_size} bytes, announced {size}")

        self._clock.lap("wait_s")
        stats = await self.blobs.fetch(cid, on_manifest=check)
        self._clock.lap("fetch_s")
        out.bytes_fetched += stats.bytes_fetched
        data = await asyncio.to_thread(self.blobs.store.read, cid)
        self._clock.lap("read_s")
        return data

    def _persist(self, version: int, ckpt: PolicyWeights, *, from_base: bool = False) -> None:
        """``from_base``: ``ckpt`` is the base file itself (version 0 built here, its hash checked), which
        is renamed into place rather than written again: for a large model, no second copy on disk."""
        old = self.version
        if from_base:
            os.replace(self.root / BASE_FILE, self.root / _ckpt_name(version))
        else:
            _write_unsynced(self.root / _ckpt_name(version), ckpt.to_bytes())
        atomic_write_text(self.root / CURRENT, json.dumps({"version": version, "hash": ckpt.content_hash}))
        if old is not None and old != version:
            (self.root / _ckpt_name(old)).unlink(missing_ok=True)
