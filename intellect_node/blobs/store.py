"""The blob store: chunk files named by their CID, signed manifests, and resume from what is on disk.

Layout under ``root`` (``<data-dir>/blobs``)::

    chunks/<chunk-cid>        one file per verified chunk (content-addressed, shared between blobs)
    manifests/<blob-cid>      the signed manifest envelope bytes (written atomically, fsynced)
    tmp/                      chunks being received; emptied at start
    dirty                     exists while a process has the store open and has not flushed it
    synced                    unix time T: every chunk file older than T is known to be on disk

A received chunk is hash-checked and only then renamed from ``tmp/`` into ``chunks/``, so a chunk file
under its CID name always held the right bytes when it was written, and "the file is there" means "the
chunk is done": a killed download resumes by asking only for the chunks without a file.

Durability without an fsync per chunk: an fsync per 4 MiB chunk forced every downloaded byte to disk
inside the transfer (half the broadcast throughput on this machine). Instead chunks are fsynced in a
batch (:meth:`BlobStore.flush`, after each fetch and at close), and the ``dirty``/``synced`` markers
catch the one case that batching opens: after an OS crash or power loss (not a killed process: its
writes are in the page cache), a chunk renamed after the last flush may be empty or torn. A store that
opens with ``dirty`` present re-hashes every chunk not older than ``synced`` and drops the bad ones,
which are then simply fetched again.

Removing blobs (:meth:`BlobStore.remove_blob`, :meth:`BlobStore.gc`; ``intellect-node blob rm/gc``): the
manifest goes first, then every chunk no other manifest lists (chunks are shared between blobs). Each is
dropped from the in-memory index before its file is unlinked, so a peer asking in between gets a 404
("not held": it tries another provider), never a half-removed blob. :meth:`BlobStore.gc` also removes
orphan chunks (listed by no manifest: what a ``blob rm`` of a blob interrupted mid-way, or an
``add_file`` killed before its manifest, leaves). Which blobs a node still needs is the caller's rule
(``commands/blob.py``: the pins and the minimum age); the store only never removes what it is told to keep.

Shortcut: damage to a chunk file older than the last flush (disk rot) is not noticed until
:meth:`BlobStore.verify_chunk` is called (fetching peers reject it).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import blake3

from intellect_node.errors import ConfigError, IntegrityError, ProtocolError, TransportError
from intellect_node.fsutil import atomic_replace_file, atomic_write_bytes, fsync_dir
from intellect_node.protocol.blob import (
    DEFAULT_CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MIN_CHUNK_SIZE,
    Manifest,
    encode_have,
    open_manifest,
    seal_manifest,
)
from intellect_node.protocol.ids import (
    BLAKE3,
    cid_from_digest,
    digest_from_cid,
    hash_code,
    new_hasher,
    validate_cid,
)
from intellect_node.protocol.signing import SigningKey

log = logging.getLogger(__name__)

COPY_BUFSIZE = 1 << 20
CHUNK_HASH = BLAKE3
"""The hash function of the chunk CIDs this store makes (``add_file``). BLAKE3 measured several times
cheaper than sha2-256 per byte here (bench/README.md, "broadcast"), and every byte a peer receives is
hashed once. Chunks are always checked with the function their CID names, so blobs published with
sha2-256 chunk CIDs (by earlier versions) are fetched, checked and served as before."""
DIRTY = "dirty"
SYNCED = "synced"
MAX_DECODED = 256
"""Decoded manifests kept in memory (the rest are read again when asked for)."""
MTIME_SLACK_S = 2.0
"""Chunks modified less than this before the ``synced`` time are re-checked too (clock granularity)."""


class ChunkWriter:
    """Receives one chunk piece by piece: hashes as it writes, refuses extra bytes, commits atomically.

    All on the event loop: ``write`` is a page-cache write of one network read, ``commit`` a close and
    a rename (the fsync comes later, batched, see the module docstring).
    """

    def __init__(self, store: "BlobStore", cid: str, length: int) -> None:
        self.cid = cid
        self.length = length
        self.received = 0
        self._store = store
        self._code = hash_code(cid)
        self._hash = new_hasher(self._code)
        self._tmp = store.tmp_dir / f"{cid}.{secrets.token_hex(4)}.part"
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        n = len(piece)
        if self.received + n > self.length:
            raise IntegrityError(f"chunk {self.cid[:16]}... longer than its {self.length} bytes")
        self._hash.update(piece)
        assert self._fd is not None
        view = memoryview(piece)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.received += n

    def check(self) -> None:
        """Raise IntegrityError unless exactly the announced bytes arrived and they hash to the CID."""
        if self.received != self.length:
            raise IntegrityError(f"chunk {self.cid[:16]}... ended after {self.received} of {self.length} "
                                 "bytes")
        if self._hash.digest() != digest_from_cid(self.cid):
            raise IntegrityError(f"chunk {self.cid[:16]}... does not match its hash")

    def commit(self) -> None:
        """Check the chunk, move it into ``chunks/`` and record it in the store."""
        self.check()
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        os.replace(self._tmp, self._store.chunk_path(self.cid))
        self._store.mark_chunk(self.cid, synced=False)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


class BlobStore:
    """Chunks and manifests on disk, plus an in-memory index of which chunks are present."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.chunks_dir = self.root / "chunks"
        self.manifests_dir = self.root / "manifests"
        self.tmp_dir = self.root / "tmp"
        for d in (self.chunks_dir, self.manifests_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self.tmp_dir.iterdir():  # pieces of chunks a killed process never finished
            leftover.unlink()
        self._chunks: set[str] = set()
        for p in self.chunks_dir.iterdir():
            if p.name.startswith("."):
                p.unlink()  # a temp file of an interrupted atomic write
            else:
                self._chunks.add(p.name)
        # Manifests are read when first asked for, not at open: a store holding many (or large) ones
        # must not cost their decoded form in memory at every start (a node that died of it would die
        # again at each restart). The CIDs are known from the file names; the newest MAX_DECODED
        # decoded manifests are kept.
        self._manifest_cids: set[str] = set()
        self._decoded: OrderedDict[str, Manifest] = OrderedDict()
        for p in self.manifests_dir.iterdir():
            if p.name.startswith("."):
                p.unlink()
                continue
            try:
                self._manifest_cids.add(validate_cid(p.name))
            except ProtocolError:
                log.warning("ignoring %s: not a blob CID", p)
        self.fetching: dict[str, int] = {}
        """Blob CID -> fetches of it under way (``blobs/fetch.py``): what a failed fetch may remove."""
        self._unsynced: set[str] = set()
        self.version = 0
        """Goes up whenever the set of chunks or manifests changes: ``GET /have?after=`` waits on it."""
        self._on_chunk: list[Callable[[], None]] = []
        self._sync_lock = threading.Lock()  # the loop adds to _unsynced while a worker thread flushes
        self._flush_lock = threading.Lock()
        if (self.root / DIRTY).exists():
            self._recheck_after_crash()
        atomic_write_bytes(self.root / DIRTY, str(os.getpid()).encode())

    def _recheck_after_crash(self) -> None:
        """Re-hash the chunks that may not have reached the disk before the last process ended."""
        try:
            since = float((self.root / SYNCED).read_text()) - MTIME_SLACK_S
        except (OSError, ValueError):
            since = 0.0
        recent = [c for c in self._chunks if self.chunk_path(c).stat().st_mtime >= since]
        bad = [c for c in recent if not self.verify_chunk(c)]
        log.info("store %s was not closed cleanly: re-checked %d chunks, dropped %d", self.root,
                 len(recent), len(bad))

    def flush(self) -> None:
        """fsync the chunks committed since the last flush (blocking: call from a worker thread)."""
        with self._flush_lock:
            t = time.time()
            with self._sync_lock:
                pending, self._unsynced = self._unsynced, set()
            self._fsync_chunks(pending)
            fsync_dir(self.chunks_dir)
            atomic_write_bytes(self.root / SYNCED, repr(t).encode())

    def _fsync_chunks(self, pending: set[str]) -> None:
        for cid in pending:
            try:
                fd = os.open(self.chunk_path(cid), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        """Flush and mark the store clean (blocking)."""
        self.flush()
        (self.root / DIRTY).unlink(missing_ok=True)
        fsync_dir(self.root)

    # -- chunks ---------------------------------------------------------------------------------

    def chunk_path(self, cid: str) -> Path:
        return self.chunks_dir / validate_cid(cid)

    def has_chunk(self, cid: str) -> bool:
        return cid in self._chunks

    def open_chunk_writer(self, cid: str, length: int) -> ChunkWriter:
        return ChunkWriter(self, cid, length)

    def mark_chunk(self, cid: str, *, synced: bool = True) -> None:
        """Record a chunk file now in ``chunks/`` (on the event loop thread) and tell the watchers."""
        self._chunks.add(cid)
        if not synced:
            with self._sync_lock:
                self._unsynced.add(cid)
        self.version += 1
        for fn in self._on_chunk:
            fn()

    def on_chunk(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (on the event loop thread) after every chunk :meth:`mark_chunk` records: the
        bulk routes wake the peers waiting for this node's next bitmap. Other changes (manifests,
        removals, which may run in worker threads) only raise :attr:`version`."""
        self._on_chunk.append(fn)

    def verify_chunk(self, cid: str) -> bool:
        """Re-hash a chunk file; drop it from the store if it no longer matches (blocking)."""
        h = new_hasher(hash_code(cid))
        try:
            with open(self.chunk_path(cid), "rb") as f:
                while piece := f.read(COPY_BUFSIZE):
                    h.update(piece)
        except FileNotFoundError:
            self._chunks.discard(cid)
            return False
        if h.digest() != digest_from_cid(cid):
            log.warning("chunk %s is damaged on disk; removing it", cid)
            self._chunks.discard(cid)
            self.chunk_path(cid).unlink(missing_ok=True)
            return False
        return True

    # -- manifests ------------------------------------------------------------------------------

    def put_manifest(self, cid: str, raw: bytes) -> Manifest:
        """Verify and store manifest envelope bytes under their CID (idempotent)."""
        m = open_manifest(raw, cid)
        if cid not in self._manifest_cids:
            atomic_write_bytes(self.manifests_dir / cid, raw)
            self._manifest_cids.add(cid)
            self.version += 1
        self._keep_decoded(cid, m)
        return m

    def _keep_decoded(self, cid: str, m: Manifest) -> None:
        self._decoded[cid] = m
        self._decoded.move_to_end(cid)
        while len(self._decoded) > MAX_DECODED:
            self._decoded.popitem(last=False)

    def manifest(self, cid: str) -> Manifest | None:
        """The blob's manifest, read from disk the first time (a damaged file is dropped: None)."""
        if cid not in self._manifest_cids:
            return None
        m = self._decoded.get(cid)
        if m is not None:
            self._decoded.move_to_end(cid)
            return m
        try:
            m = open_manifest((self.manifests_dir / cid).read_bytes(), cid)
        except (OSError, ProtocolError) as exc:
            log.warning("ignoring damaged or missing manifest %s: %s", cid, exc)
            self._manifest_cids.discard(cid)
            return None
        self._keep_decoded(cid, m)
        return m

    def _manifest(self, cid: str) -> Manifest:
        m = self.manifest(cid)
        if m is None:
            raise KeyError(cid)
        return m

    def manifest_bytes(self, cid: str) -> bytes | None:
        if cid not in self._manifest_cids:
            return None
        try:
            return (self.manifests_dir / cid).read_bytes()
        except FileNotFoundError:
            return None

    def manifest_cids(self) -> list[str]:
        return sorted(self._manifest_cids)

    def present(self, cid: str) -> list[bool]:
        m = self._manifest(cid)
        return [c in self._chunks for c in m.chunks]

    def have_bytes(self, cid: str) -> bytes | None:
        if self.manifest(cid) is None:
            return None
        return encode_have(cid, self.present(cid))

    def missing(self, cid: str) -> list[int]:
        return [i for i, ok in enumerate(self.present(cid)) if not ok]

    def is_complete(self, cid: str) -> bool:
        return self.manifest(cid) is not None and not self.missing(cid)

    # -- listing and removal ----------------------------------------------------------------------

    def blob_info(self, cid: str) -> dict[str, object]:
        """What ``blob ls`` shows of one blob: name, size, bytes held here, complete, publisher, and when
        its manifest arrived (unix seconds)."""
        m = self._manifest(cid)
        present = self.present(cid)
        held = sum(m.chunk_length(i) for i, ok in enumerate(present) if ok)
        try:
            since = (self.manifests_dir / cid).stat().st_mtime
        except FileNotFoundError:
            since = 0.0
        return {"cid": cid, "name": m.name, "size": m.total_size, "held": held, "chunks": len(m.chunks),
                "complete": all(present), "publisher": m.publisher, "since": since}

    def _referenced(self) -> set[str]:
        """Chunk CIDs listed by some manifest (reads every manifest: blocking)."""
        out: set[str] = set()
        for cid in list(self._manifest_cids):
            if (m := self.manifest(cid)) is not None:
                out.update(m.chunks)
        return out

    def _drop_chunks(self, cids: set[str]) -> int:
        self.version += 1
        freed = 0
        for c in cids:
            self._chunks.discard(c)
            path = self.chunk_path(c)
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
        return freed

    def remove_blob(self, cid: str) -> int:
        """Remove a blob: its manifest, and its chunks that no other blob lists. Returns the bytes freed
        (blocking: call from a worker thread on a running node). ConfigError when it is not held."""
        validate_cid(cid)
        m = self.manifest(cid)
        self._manifest_cids.discard(cid)
        self._decoded.pop(cid, None)
        if m is None:
            raise ConfigError(f"blob {cid} is not in {self.root}; `intellect-node blob ls` lists what is",
                              field="cid")
        path = self.manifests_dir / cid
        freed = path.stat().st_size if path.exists() else 0
        path.unlink(missing_ok=True)
        fsync_dir(self.manifests_dir)  # a crash must not bring the manifest back over missing chunks
        return freed + self._drop_chunks(set(m.chunks) - self._referenced())

    def forget_blob(self, cid: str, chunks: set[str]) -> None:
        """Drop a blob's manifest and ``chunks`` (the caller knows no other blob needs them: the ones a
        failed fetch itself brought) without reading the other manifests or waiting for the disk: a
        manifest that a crash brings back only costs a refetch or a ``blob gc``. On the event loop."""
        if cid not in self._manifest_cids:
            return
        self._manifest_cids.discard(cid)
        self._decoded.pop(cid, None)
        self.version += 1
        (self.manifests_dir / cid).unlink(missing_ok=True)
        if chunks:
            self._drop_chunks(chunks)

    def gc(self, keep: set[str], *, older_than: float) -> tuple[list[str], int, int]:
        """Remove every blob not in ``keep`` whose manifest arrived before ``older_than`` (unix seconds),
        then the orphan chunks older than that. Returns ``(blob CIDs removed, orphan chunks removed,
        bytes freed)``. Blocking."""
        removed: list[str] = []
        freed = 0
        for cid in self.manifest_cids():
            try:
                since = (self.manifests_dir / cid).stat().st_mtime
            except FileNotFoundError:
                continue
            if cid not in keep and since < older_than:
                freed += self.remove_blob(cid)
                removed.append(cid)
        referenced = self._referenced()
        orphans = set()
        for path in self.chunks_dir.iterdir():
            if path.name in referenced or path.name.startswith("."):
                continue
            try:
                if path.stat().st_mtime < older_than:
                    orphans.add(validate_cid(path.name))
            except (FileNotFoundError, ProtocolError):
                continue
        freed += self._drop_chunks(orphans)
        return removed, len(orphans), freed

    # -- whole files ----------------------------------------------------------------------------

    def add_file(self, path: str | os.PathLike[str], key: SigningKey, *, name: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                 on_bytes: Callable[[int, int], None] | None = None) -> tuple[str, Manifest]:
        """Cut a local file into chunks, store them and a signed manifest; return ``(blob_cid, manifest)``.

        Blocking (reads and hashes the whole file): call it from a worker thread on a running node.
        ``on_bytes(done, total)`` after each chunk (from this thread): a large file takes minutes.
        """
        src = Path(path)
        if not src.is_file():
            raise ConfigError(f"{src} is not a readable file; pass the path of the file to publish",
                              field="file")
        if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"chunk size {chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]",
                              field="chunk_size")
        total = src.stat().st_size
        if -(-total // chunk_size) > MAX_CHUNKS:
            raise ConfigError(f"{src} needs more than {MAX_CHUNKS} chunks of {chunk_size} bytes; "
                              "use a larger chunk size", field="chunk_size")
        cids: list[str] = []
        with open(src, "rb") as f:
            while data := f.read(chunk_size):
                cid = cid_from_digest(_chunk_digest(data), CHUNK_HASH)
                if cid not in self._chunks:
                    atomic_write_bytes(self.chunk_path(cid), data)
                    self._chunks.add(cid)
                cids.append(cid)
                if on_bytes is not None:
                    on_bytes(min(len(cids) * chunk_size, total), total)
        if sum(min(chunk_size, total - i * chunk_size) for i in range(len(cids))) != total:
            raise IntegrityError(f"{src} changed while it was being read")
        manifest = Manifest(name=name or src.name, publisher=key.peer_id, chunk_size=chunk_size,
                            total_size=total, chunks=cids)
        cid, raw = seal_manifest(key, manifest)
        self.put_manifest(cid, raw)
        return cid, manifest

    def _chunk_files(self, m: Manifest) -> Iterator[tuple[int, int]]:
        """Each chunk of ``m`` in order as (open file descriptor, length), its size on disk checked: how a
        blob is assembled from its chunks (:meth:`export` to a file, :meth:`read` into memory)."""
        for i, c in enumerate(m.chunks):
            n = m.chunk_length(i)
            with open(self.chunk_path(c), "rb") as fi:
                if os.fstat(fi.fileno()).st_size != n:
                    raise IntegrityError(f"chunk {c} has the wrong size on disk")
                yield fi.fileno(), n

    def read(self, cid: str) -> bytearray:
        """The content of a complete blob (blocking; call after its fetch). TransportError when it is not
        complete here, IntegrityError when a chunk on disk has the wrong size."""
        m = self.manifest(cid)
        if m is None or self.missing(cid):
            raise TransportError(f"blob {cid} is not complete")
        buf = bytearray(m.total_size)
        view = memoryview(buf)
        pos = 0
        for fd, n in self._chunk_files(m):
            while n:
                got = os.readv(fd, [view[pos:pos + n]])
                if got == 0:
                    raise IntegrityError(f"blob {cid}: a chunk file is shorter than expected")
                pos += got
                n -= got
        return buf

    def export(self, cid: str, out: str | os.PathLike[str],
               on_bytes: Callable[[int, int], None] | None = None) -> Path:
        """Assemble a complete blob into ``out`` atomically (blocking; kernel-side copies).

        ``on_bytes(done, total)`` after each chunk; the last call, ``(total, total)``, comes before the
        final fsync, which for a large file on a slow disk takes seconds of its own."""
        m = self.manifest(cid)
        if m is None or self.missing(cid):
            raise IntegrityError(f"blob {cid} is not complete in {self.root}")
        dst = Path(out)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as fo:
                for i, (fd, n) in enumerate(self._chunk_files(m)):
                    _copy_range(fd, fo.fileno(), n)
                    if on_bytes is not None:
                        on_bytes(min((i + 1) * m.chunk_size, m.total_size), m.total_size)
            atomic_replace_file(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return dst


def _chunk_digest(data: bytes) -> bytes:
    """BLAKE3 of a whole chunk on every core (publication hashes a checkpoint at once; a received chunk
    is hashed piece by piece as it arrives instead, in ChunkWriter)."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()


def _copy_range(fd_in: int, fd_out: int, n: int) -> None:
    """Copy ``n`` bytes between files without passing them through Python where the kernel allows."""
    left = n
    try:
        while left:
            copied = os.copy_file_range(fd_in, fd_out, left)
            if copied == 0:
                raise IntegrityError("chunk file shorter than expected")
            left -= copied
        return
    except OSError:
        if left != n:
            raise
    while left:
        piece = os.read(fd_in, min(COPY_BUFSIZE, left))
        if not piece:
            raise IntegrityError("chunk file shorter than expected")
        os.write(fd_out, piece)
        left -= len(piece)
