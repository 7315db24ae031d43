"""What a fresh key's notice makes a node store is bounded by what it announced.

A ~1 MiB manifest listing 16,384 copies of one tiny chunk was written to disk and held decoded before
the announced size was checked, never removed, and decoded again at every start. Now a fetch under a
``Budget`` checks the manifest's bytes, chunk count and repeated chunks against the announced size before
anything is stored; a failed fetch of an unproven peer's blob leaves no file; and a store decodes its
manifests only when asked for them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Sequence

import pytest
from aiohttp import web

from intellect_node.blobs import fetch as fetch_mod
from intellect_node.blobs.fetch import Budget, Fetcher, Provider, StaticProvider
from intellect_node.blobs.http import HttpChunkSource
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import IntegrityError, TransportError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.protocol.blob import MAX_CHUNKS, Manifest, seal_manifest
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey
from tests.support.blob_server import serve_store

MALLORY = SigningKey.generate()


def _forged(store: BlobStore, *, chunk: int, copies: int, name: str = "rollouts") -> tuple[str, int]:
    """A blob of ``copies`` times the same ``chunk`` bytes in ``store``: (CID, announced size)."""
    data = b"z" * chunk
    c = cid_of(data)
    atomic_write_bytes(store.chunk_path(c), data)
    store.mark_chunk(c)
    m = Manifest(name=name, publisher=MALLORY.peer_id, chunk_size=chunk, total_size=chunk * copies,
                 chunks=[c] * copies)
    cid, raw = seal_manifest(MALLORY, m)
    store.put_manifest(cid, raw)
    return cid, m.total_size


async def _serve(store: BlobStore) -> tuple[web.AppRunner, str]:
    return await serve_store(store)


def _fetch(tmp: Path, url: str, cid: str, budget: Budget | None,
           penalised: list[tuple[str, str]]) -> tuple[BlobStore, BaseException | None]:
    store = BlobStore(tmp / "trainer")

    async def find(c: str) -> Sequence[Provider]:
        return [StaticProvider(MALLORY.peer_id, url)]

    async def run() -> BaseException | None:
        src = HttpChunkSource(read_timeout=5.0)
        f = Fetcher(store, [src], find, find_timeout=0.0, penalise=lambda p, r: penalised.append((p, r)))
        try:
            await f.fetch(cid, budget=budget)
        except (IntegrityError, TransportError) as exc:
            return exc
        finally:
            src.close()
        return None

    return store, asyncio.run(run())


@pytest.mark.parametrize(("chunk", "copies", "why"), [
    (1024, MAX_CHUNKS, "bytes"),             # 16,384 copies of 1 KiB: a 1 MiB manifest for 16 MiB
    (4096, 2048, "bytes"),                   # small chunks: a manifest far larger than the size needs
    (4096, 4, "chunks of 4096"),             # small chunks, small manifest
    (256 * 1024, 8, "more than 4 times"),    # repeats of one honest-sized chunk
])
def test_a_forged_manifest_is_refused_before_it_is_stored(tmp_path: Path, chunk: int, copies: int, why: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_mod, "REDISCOVER_ROUNDS", 1)
    mallory = BlobStore(tmp_path / "mallory")
    cid, size = _forged(mallory, chunk=chunk, copies=copies)
    penalised: list[tuple[str, str]] = []

    async def serve_and_fetch() -> tuple[BlobStore, BaseException | None]:
        runner, url = await _serve(mallory)
        try:
            return await asyncio.to_thread(_fetch, tmp_path, url, cid, Budget(max_size=64 << 20, size=size),
                                           penalised)
        finally:
            await runner.cleanup()

    store, err = asyncio.run(serve_and_fetch())
    assert isinstance(err, IntegrityError) and why in str(err)
    assert store.manifest(cid) is None and not any(store.manifests_dir.iterdir())
    assert not any(store.chunks_dir.iterdir())
    assert penalised == []  # the bytes are the ones the CID names: the blob is refused, not the provider


def test_a_failed_fetch_of_an_unproven_peers_blob_leaves_nothing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider serves the manifest and some chunks, then nothing: no file of it stays behind."""
    monkeypatch.setattr(fetch_mod, "REDISCOVER_ROUNDS", 1)
    monkeypatch.setattr(fetch_mod, "STALL_S", 0.5)  # the pass gives up on it sooner; the same ending
    mallory = BlobStore(tmp_path / "mallory")
    key = SigningKey.generate()
    src_file = tmp_path / "batch"
    src_file.write_bytes(os.urandom(1 << 20))  # 1 MiB: four 256 KiB chunks
    cid, m = mallory.add_file(src_file, key, chunk_size=256 * 1024)
    for c in m.chunks[1:]:  # it holds (serves) only the first chunk
        mallory.chunk_path(c).unlink()
        mallory._chunks.discard(c)

    async def serve_and_fetch() -> tuple[BlobStore, BaseException | None]:
        runner, url = await _serve(mallory)
        try:
            return await asyncio.to_thread(_fetch, tmp_path, url, cid,
                                           Budget(max_size=64 << 20, size=m.total_size), [])
        finally:
            await runner.cleanup()

    store, err = asyncio.run(serve_and_fetch())
    assert isinstance(err, TransportError)
    assert store.manifest(cid) is None and not any(store.manifests_dir.iterdir())
    assert not any(store.chunks_dir.iterdir())


def test_manifests_are_read_when_asked_for(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "s")
    cids = [_forged(store, chunk=1024, copies=64, name=f"b{i}")[0] for i in range(20)]
    store.close()
    again = BlobStore(tmp_path / "s")
    assert not again._decoded  # nothing decoded at open
    assert again.manifest_cids() == sorted(cids)
    m = again.manifest(cids[3])
    assert m is not None and m.name == "b3" and list(again._decoded) == [cids[3]]
    (again.manifests_dir / cids[5]).write_bytes(b"damaged")
    assert again.manifest(cids[5]) is None and cids[5] not in again.manifest_cids()
