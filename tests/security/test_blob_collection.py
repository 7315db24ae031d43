"""A node removes the blobs nobody pinned by itself.

Blobs a fresh key's notices made the trainer or a validator fetch stayed on disk until an operator ran
``intellect-node blob gc``. Now every joined node applies the same rule every ``GC_EVERY_S``
(``BlobService.collect_loop``, wired by ``node/assembly.py``): a blob older than an hour that is not in
the trainer's announced policy chain goes, with its chunks. A real node runtime with its common
services, its store holding an old unpinned blob, an old pinned one (the trainer's layout on disk) and a
young one; and the rule's refusal to remove anything while the trainer's state is unreadable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

import pytest

from intellect_node.blobs import service as blob_service
from intellect_node.blobs.service import BlobService
from intellect_node.blobs.store import BlobStore
from intellect_node.config import build_config
from intellect_node.node.assembly import build_node
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.pins import GC_MIN_AGE_S, PUBLISHER_STATE, TRAINER_POLICY_DIR, published_pins
from tests.support.wait import wait_until

KEY = SigningKey.generate()


def _blob(store: BlobStore, tmp: Path, name: str, *, age_s: float) -> str:
    src = tmp / f"{name}.bin"
    src.write_bytes(os.urandom(64 * 1024))
    cid, m = store.add_file(src, KEY, name=name, chunk_size=16 * 1024)
    then = time.time() - age_s
    os.utime(store.manifests_dir / cid, (then, then))
    for c in m.chunks:
        os.utime(store.chunk_path(c), (then, then))
    return cid


def _pin(data_dir: Path, cid: str) -> None:
    d = data_dir / TRAINER_POLICY_DIR
    d.mkdir(parents=True, exist_ok=True)
    state = {"version": 5, "hash": "h", "full": [5, cid, 1], "links": []}
    (d / PUBLISHER_STATE).write_text(json.dumps(state))


def test_a_running_node_collects_old_unpinned_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blob_service, "GC_EVERY_S", 0.05)
    data_dir = tmp_path / "node"
    store = BlobStore(data_dir / "blobs")
    old = _blob(store, tmp_path, "old-batch", age_s=2 * GC_MIN_AGE_S)
    pinned = _blob(store, tmp_path, "policy", age_s=2 * GC_MIN_AGE_S)
    young = _blob(store, tmp_path, "young-batch", age_s=60)
    store.close()
    _pin(data_dir, pinned)
    assert set(published_pins(data_dir)) == {pinned}

    async def main() -> None:
        cfg = build_config(network={"http_host": "127.0.0.1"}, metrics={"enabled": False},
                           run={"run_id": "gc-test"})
        rt = build_node(cfg, data_dir)
        await rt.start()
        try:
            blobs = next(s for s in rt.services if isinstance(s, BlobService))
            # the count moves once the collection's thread has finished (the index drops a blob earlier)
            await wait_until(lambda: blobs.collected["blobs"], 30, what="a collection that removed a blob")
            assert old not in blobs.store.manifest_cids()
            assert set(blobs.store.manifest_cids()) == {pinned, young}
            assert not blobs.store.missing(pinned) and not blobs.store.missing(young)
            assert rt.status()["blobs"]["collected"]["blobs"] == 1
        finally:
            await rt.stop()

    asyncio.run(main())


def test_nothing_is_collected_while_the_trainers_state_is_unreadable(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "node"
    store = BlobStore(data_dir / "blobs")
    old = _blob(store, tmp_path, "policy", age_s=2 * GC_MIN_AGE_S)
    (data_dir / TRAINER_POLICY_DIR).mkdir(parents=True)
    (data_dir / TRAINER_POLICY_DIR / PUBLISHER_STATE).write_text("{torn")
    svc = BlobService(store, KEY)
    rounds = 3

    async def main() -> None:
        loop = asyncio.create_task(svc.collect_loop(lambda: published_pins(data_dir), min_age=GC_MIN_AGE_S,
                                                    every=0.01))
        def skipped() -> int:
            return sum("blob collection skipped" in r.message for r in caplog.records)

        await wait_until(lambda: skipped() >= rounds, 10, what="rounds skipped")
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="intellect_node.blobs.service"):
        asyncio.run(main())
    assert store.manifest_cids() == [old] and svc.collected == {"blobs": 0, "bytes": 0}
    store.close()
