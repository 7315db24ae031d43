"""Publisher and followers over real blob services on 127.0.0.1: deltas, anchors, late joiners,
corrupted and wrong-base deltas falling back to the full checkpoint, restarts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from intellect_node.blobs.peer import BlobPeer, mesh
from intellect_node.config.status import StatusBoard
from intellect_node.errors import IntegrityError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.policy.delta import encode_delta, read_delta
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol import codec
from intellect_node.protocol.policy import DeltaFile, PolicyAnnouncement, open_announcement, seal_announcement
from intellect_node.roles.common.policy import ObtainResult, PolicyFollower, PolicyPublisher
from tests.support.delta import policy_versions
from tests.support.wait import wait_until

torch.set_num_threads(1)
RUN = "delta-test"
LIMIT = 1 << 24


async def _peers(tmp: Path, n: int) -> list[BlobPeer]:
    peers = [await BlobPeer(tmp / f"blobs{i}").start() for i in range(n)]
    mesh(peers)
    return peers


def _follower(tmp: Path, name: str, peer: BlobPeer, trainer: str, **kw: Any) -> PolicyFollower:
    return PolicyFollower(tmp / name, peer.blobs, run_id=RUN, trainer=trainer, max_checkpoint_bytes=LIMIT,
                          **kw)


def test_chain_anchors_late_joiner_and_restart(tmp_path: Path) -> None:
    versions = policy_versions(torch.bfloat16, 7)

    async def main() -> None:
        trainer, a, b, c = peers = await _peers(tmp_path, 4)
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=3)
            fa = _follower(tmp_path, "a", a, trainer.key.peer_id)
            anns: list[PolicyAnnouncement] = []
            assert pub.announcement() is None  # nothing published yet
            for v in range(6):
                ann, raw = await pub.publish(v, versions[v].to_state_dict())
                assert open_announcement(raw, run_id=RUN, trainer=trainer.key.peer_id) == ann
                assert pub.announcement() == (ann, raw)
                anns.append(ann)
                got = await fa.obtain(ann)
                assert bytes(got.checkpoint.to_bytes()) == bytes(versions[v].to_bytes())
                assert got.path == ("full" if v == 0 else "delta")
                if v:  # a delta costs a fraction of the checkpoint on the wire
                    assert 0 < got.bytes_fetched < versions[v].nbytes / 2
                # Where the time went is told (a worker logs it to worker/hops.jsonl).
                assert {"fetch_s", "apply_s", "persist_s"} <= set(got.timings) and fa.last is got
                assert {"save_s", "state_s"} <= set(pub.timings) and ("delta_s" in pub.timings) == (v > 0)
            assert [x.full_version for x in anns] == [0, 0, 0, 3, 3, 3]
            chains = [[link.version for link in x.deltas] for x in anns]
            assert chains == [[], [1], [1, 2], [3], [3, 4], [3, 4, 5]]
            assert (await fa.obtain(anns[5])).path == "current"
            assert (await fa.obtain(anns[4])).path == "stale"

            # A late joiner starts from the latest full checkpoint (v3) and walks two deltas.
            board = StatusBoard(role="worker")
            late = await _follower(tmp_path, "b", b, trainer.key.peer_id, board=board).obtain(anns[5])
            assert board.snapshot().policy.local == board.snapshot().policy.current == 5
            assert late.path == "full" and late.deltas_applied == 2 and late.fallback == "no policy held"
            assert bytes(late.checkpoint.to_bytes()) == bytes(versions[5].to_bytes())

            # A worker further behind than the chain (v1, chain 3..5) also goes through v3's full copy.
            fc = _follower(tmp_path, "c", c, trainer.key.peer_id)
            await fc.obtain(anns[1])
            behind = await fc.obtain(anns[5])
            assert behind.path == "full" and "not on the announced chain" in behind.fallback
            assert bytes(behind.checkpoint.to_bytes()) == bytes(versions[5].to_bytes())

            # Both sides restart from disk and carry on with the same chain.
            pub2 = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=3)
            assert pub2.version == 5
            # The restarted trainer re-announces v5 from the publisher's state: the same signed bytes.
            assert pub2.announcement() == (anns[5], raw)
            ann6, _ = await pub2.publish(6, versions[6])
            assert ann6.full_version == 6 and [link.version for link in ann6.deltas] == [6]
            fa2 = _follower(tmp_path, "a", a, trainer.key.peer_id)
            assert fa2.version == 5 and fa2.checkpoint_path is not None
            assert fa2.checkpoint_path.read_bytes() == bytes(versions[5].to_bytes())
            got = await fa2.obtain(ann6)
            assert got.path == "delta" and bytes(got.checkpoint.to_bytes()) == bytes(versions[6].to_bytes())
            with pytest.raises(ValueError, match="not after"):
                await pub2.publish(6, versions[6])
        finally:
            for p in peers:
                await p.stop()

    asyncio.run(main())


def _forged_delta_announcement(trainer: BlobPeer, tmp: Path, ann: PolicyAnnouncement,
                               delta: bytes) -> tuple[PolicyAnnouncement, bytes]:
    """Put ``delta`` in the trainer's store and re-announce ``ann`` with it as the last link."""
    path = tmp / "forged.delta"
    atomic_write_bytes(path, delta)
    cid, _ = trainer.blobs.store.add_file(path, trainer.key)
    link = msgspec.structs.replace(ann.deltas[-1], delta_cid=cid, delta_size=len(delta))
    forged = msgspec.structs.replace(ann, deltas=[*ann.deltas[:-1], link])
    return forged, seal_announcement(trainer.key, forged)


def test_corrupted_or_wrong_base_delta_falls_back_to_full(tmp_path: Path) -> None:
    versions = policy_versions(torch.float32, 3)
    other_base = PolicyWeights.from_state_dict({k: v + 1 for k, v in versions[1].to_state_dict().items()})

    async def main() -> None:
        trainer, w = peers = await _peers(tmp_path, 2)
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=1)
            anns = [(await pub.publish(v, versions[v]))[0] for v in range(3)]
            good = encode_delta(versions[1], versions[2])
            d = codec.decode(good, DeltaFile, max_size=LIMIT)
            t0 = d.tensors[0]
            flipped = bytearray(t0.data)
            flipped[len(flipped) // 2] ^= 0x10
            corrupted = codec.encode(msgspec.structs.replace(
                d, tensors=[msgspec.structs.replace(t0, data=bytes(flipped)), *d.tensors[1:]]))
            # A delta made against another base, relabelled as if it started from v1.
            wrong_base = encode_delta(other_base, versions[2])
            assert read_delta(wrong_base, max_size=LIMIT).base_hash != versions[1].content_hash
            for name, bad in (("corrupted", corrupted), ("wrong-base", wrong_base)):
                rejections: list[tuple[str, str]] = []
                fol = _follower(tmp_path, name, w, trainer.key.peer_id,
                                on_reject=lambda peer, why: rejections.append((peer, why)))
                assert (await fol.obtain(anns[1])).path in ("full", "delta")
                forged, _ = _forged_delta_announcement(trainer, tmp_path, anns[2], bad)
                got = await fol.obtain(forged)
                assert got.path == "full" and got.fallback.startswith("delta failed"), (name, got.fallback)
                assert bytes(got.checkpoint.to_bytes()) == bytes(versions[2].to_bytes())
                assert rejections and rejections[0][0] == trainer.key.peer_id
        finally:
            for p in peers:
                await p.stop()

    asyncio.run(main())


def test_diverged_copy_and_hopeless_chain(tmp_path: Path) -> None:
    versions = policy_versions(torch.bfloat16, 3)

    async def main() -> None:
        trainer, w = peers = await _peers(tmp_path, 2)
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=8)
            anns = [(await pub.publish(v, versions[v]))[0] for v in range(3)]
            fol = _follower(tmp_path, "w", w, trainer.key.peer_id)
            await fol.obtain(anns[0])
            # The worker's copy of v1 is not the trainer's (a local bug, a disk error that still parses).
            mine = PolicyWeights.from_state_dict({k: v * 2 for k, v in versions[1].to_state_dict().items()})
            fol.version, fol.checkpoint = 1, mine
            got = await fol.obtain(anns[2])
            assert got.path == "full" and "differs" in got.fallback and got.deltas_applied == 2
            assert bytes(got.checkpoint.to_bytes()) == bytes(versions[2].to_bytes())

            # With the only full copy far back and the last delta corrupted, no path reaches v2: the
            # node says so and keeps what it holds.
            fresh = _follower(tmp_path, "fresh", w, trainer.key.peer_id)
            await fresh.obtain(anns[1])
            d = codec.decode(encode_delta(versions[1], versions[2]), DeltaFile, max_size=LIMIT)
            bad = codec.encode(msgspec.structs.replace(d, target_hash=versions[0].content_hash))
            forged, _ = _forged_delta_announcement(trainer, tmp_path, anns[2], bad)
            with pytest.raises(IntegrityError):
                await fresh.obtain(forged)
            assert fresh.version == 1 and fresh.checkpoint is not None
            assert fresh.checkpoint.content_hash == versions[1].content_hash

            # A follower whose size limit is below the checkpoint refuses before downloading it.
            small = PolicyFollower(tmp_path / "small", w.blobs, run_id=RUN, trainer=trainer.key.peer_id,
                                   max_checkpoint_bytes=versions[0].nbytes - 1)
            with pytest.raises(IntegrityError, match="over the limit"):
                await small.obtain(anns[2])
        finally:
            for p in peers:
                await p.stop()

    asyncio.run(main())


async def _until(pred: Callable[[], object], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def test_follow_retries_then_takes_the_newest_offer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    versions = policy_versions(torch.bfloat16, 4)

    async def main() -> None:
        trainer, w = peers = await _peers(tmp_path, 2)
        task = None
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=8)
            anns = [(await pub.publish(v, versions[v]))[0] for v in range(4)]
            fol = _follower(tmp_path, "w", w, trainer.key.peer_id)
            got: list[tuple[int, str]] = []
            task = asyncio.create_task(fol.follow(lambda r: got.append((r.version, r.path)), retries=1,
                                                  backoff_s=0.05))
            # An announcement whose full checkpoint is over this node's limit: tried twice, given up.
            over = msgspec.structs.replace(anns[1], full_size=LIMIT + 1)
            fol.offer(over)
            await _until(lambda: sum("not obtained" in r.message for r in caplog.records) == 2)
            fol.offer(over)  # offered again (the trainer repeats its newest announcement): tried again
            await _until(lambda: sum("not obtained" in r.message for r in caplog.records) == 4)
            for ann in (anns[0], anns[2], anns[3], anns[1]):  # only the newest is worth obtaining
                fol.offer(ann)
            await _until(lambda: fol.version == 3)
            assert got == [(3, "full")]
            assert bytes(fol.checkpoint.to_bytes()) == bytes(versions[3].to_bytes())  # type: ignore[union-attr]  # set by now
        finally:
            if task is not None:
                task.cancel()
            for p in peers:
                await p.stop()

    asyncio.run(main())


def test_versions_passed_on_the_way_reach_on_passing(tmp_path: Path) -> None:
    """A validator that skipped versions (the newest offered wins) still holds those within its window:
    the delta walk hands each one it passes through, hash-checked, to ``on_passing``."""
    versions = policy_versions(torch.bfloat16, 7)

    async def main() -> None:
        trainer, v1, v2 = peers = await _peers(tmp_path, 3)
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=4)
            anns = [(await pub.publish(v, versions[v]))[0] for v in range(7)]
            passed: list[tuple[int, bytes]] = []

            async def on_passing(version: int, ckpt: PolicyWeights) -> None:
                passed.append((version, bytes(ckpt.to_bytes())))

            # By deltas: held v0, obtains v3 with a window of 1: v1 is outside it, v2 is passed.
            fa = _follower(tmp_path, "a", v1, trainer.key.peer_id, on_passing=on_passing, keep_passing=1)
            await fa.obtain(anns[0])
            assert passed == []  # nothing passed on the way to a first version at the anchor
            got = await fa.obtain(anns[3])
            assert got.path == "delta" and got.deltas_applied == 3
            assert passed == [(2, bytes(versions[2].to_bytes()))]
            # From the full checkpoint (v4, then deltas to v6): v4 and v5 are both in a window of 2.
            passed.clear()
            fb = _follower(tmp_path, "b", v2, trainer.key.peer_id, on_passing=on_passing, keep_passing=2)
            got = await fb.obtain(anns[6])
            assert got.path == "full" and anns[6].full_version == 4
            assert passed == [(4, bytes(versions[4].to_bytes())), (5, bytes(versions[5].to_bytes()))]
            # Without a window (workers) nothing is passed.
            passed.clear()
            fc = _follower(tmp_path, "c", v2, trainer.key.peer_id, on_passing=on_passing)
            await fc.obtain(anns[6])
            assert passed == []
        finally:
            for p in peers:
                await p.stop()

    asyncio.run(main())


def test_follow_with_a_window_obtains_the_version_before_an_anchor(tmp_path: Path) -> None:
    """v3 and v4 offered together, v4 an anchor whose chain starts at v4: no walk passes through v3, so a
    follower with a window obtains v3, then v4; one without (a worker) takes only the newest."""
    versions = policy_versions(torch.bfloat16, 5)

    async def main() -> None:
        trainer, a, b = peers = await _peers(tmp_path, 3)
        tasks: list[asyncio.Task[None]] = []
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=4)
            anns = [(await pub.publish(v, versions[v]))[0] for v in range(5)]
            assert [link.version for link in anns[4].deltas] == [4] and anns[4].full_version == 4
            got: dict[str, list[tuple[int, str]]] = {"window": [], "worker": []}
            fols = {}
            for name, peer, keep in (("window", a, 2), ("worker", b, 0)):
                fol = _follower(tmp_path, name, peer, trainer.key.peer_id, keep_passing=keep)
                await fol.obtain(anns[2])
                fols[name] = fol
                out = got[name]

                def record(r: ObtainResult, out: list[tuple[int, str]] = out) -> None:
                    out.append((r.version, r.path))

                follow = fol.follow(record)
                tasks.append(asyncio.create_task(follow))
                fol.offer(anns[3])
                fol.offer(anns[4])
                fol.offer(anns[4])  # the trainer's repeat
            await _until(lambda: all(f.version == 4 for f in fols.values()))
            assert got["window"] == [(3, "delta"), (4, "delta")]
            assert got["worker"] == [(4, "full")]
        finally:
            for t in tasks:
                t.cancel()
            for p in peers:
                await p.stop()

    asyncio.run(main())


def test_policy_files_published_in_the_configured_chunk_size(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``rl.policy_chunk_mib``: the full file and the delta go out in that chunk size, and a file that
    would need more than MAX_CHUNKS chunks gets doubled chunks instead of a failed publication."""
    from intellect_node.errors import ConfigError
    from intellect_node.roles.common import policy as policy_mod

    versions = policy_versions(torch.bfloat16, 2)

    async def main() -> None:
        trainer, a = peers = await _peers(tmp_path, 2)
        try:
            with pytest.raises(ConfigError, match="chunk_size"):
                PolicyPublisher(tmp_path / "x", trainer.blobs, trainer.key, RUN, chunk_size=100)
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=8,
                                  chunk_size=4096)
            ann0, _ = await pub.publish(0, versions[0].to_state_dict())
            m0 = trainer.blobs.store.manifest(ann0.full_cid)
            assert m0 is not None and m0.chunk_size == 4096 and len(m0.chunks) > 1
            monkeypatch.setattr(policy_mod, "MAX_CHUNKS", 2)  # as if the files were thousands of times larger
            ann1, _ = await pub.publish(1, versions[1].to_state_dict())
            m1 = trainer.blobs.store.manifest(ann1.deltas[-1].delta_cid)
            assert m1 is not None and len(m1.chunks) <= 2 and m1.chunk_size >= 4096
            got = await _follower(tmp_path, "a", a, trainer.key.peer_id).obtain(ann1)
            assert bytes(got.checkpoint.to_bytes()) == bytes(versions[1].to_bytes())
        finally:
            for p in peers:
                await p.stop()

    asyncio.run(main())


def test_version_0_is_built_from_the_model_folder_when_it_hashes_as_the_trainers(tmp_path: Path) -> None:
    """A fresh trainer's version 0 is the run's model as it loads it; a follower holding the same model
    folder builds those bytes itself and fetches only the deltas after it. A folder that differs, a build
    that fails, or a chain that no longer starts at version 0 fetch the full checkpoint as before."""
    from intellect_node.roles.common.policy import BASE_FILE
    from intellect_node.trainer.model import initial_policy, load_trainable

    trained = load_trainable(None)  # what a fresh trainer holds and publishes as version 0
    v0 = {k: t.detach().clone() for k, t in trained.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    v1 = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in v0.items()}
    v2 = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in v1.items()}
    calls: list[str] = []

    def local(dest: Path) -> PolicyWeights:
        calls.append("local")
        return initial_policy(None, dest)

    def other(dest: Path) -> PolicyWeights:  # another model under the same name
        return PolicyWeights.write(dest, {k: t + 1 for k, t in v0.items()})

    def broken(dest: Path) -> PolicyWeights:
        raise OSError("No space left on device")

    async def main() -> None:
        trainer, a, b, c, d = peers = await _peers(tmp_path, 5)
        try:
            pub = PolicyPublisher(tmp_path / "pub", trainer.blobs, trainer.key, RUN, full_every=3)
            anns = [(await pub.publish(v, s))[0] for v, s in enumerate((v0, v1, v2))]
            want = bytes(PolicyWeights.from_state_dict(v2).to_bytes())

            fa = _follower(tmp_path, "a", a, trainer.key.peer_id, base=local)
            fa.prepare_base()
            got = await fa.obtain(anns[2])
            assert got.path == "local" and got.deltas_applied == 2, (got.path, got.fallback)
            assert bytes(got.checkpoint.to_bytes()) == want
            deltas = sum(link.delta_size for link in anns[2].deltas)
            assert got.bytes_fetched == deltas  # the deltas, nothing of the full checkpoint
            assert a.blobs.store.manifest(anns[2].full_cid) is None
            assert calls == ["local"] and not (tmp_path / "a" / BASE_FILE).exists()
            assert _follower(tmp_path, "a", a, trainer.key.peer_id, base=local).version == 2  # persisted

            # Version 0 itself is held as the file built here (renamed into place, not written twice).
            f0 = _follower(tmp_path, "a0", a, trainer.key.peer_id, base=local)
            got = await f0.obtain(anns[0])
            assert (got.path, got.version, got.bytes_fetched) == ("local", 0, 0)
            assert f0.checkpoint_path is not None and sorted(p.name for p in (tmp_path / "a0").iterdir()) == [
                "CURRENT", f0.checkpoint_path.name]
            assert f0.checkpoint_path.read_bytes() == bytes(PolicyWeights.from_state_dict(v0).to_bytes())
            assert _follower(tmp_path, "a0", a, trainer.key.peer_id).version == 0

            for name, peer, build in (("b", b, other), ("c", c, broken)):
                f = _follower(tmp_path, name, peer, trainer.key.peer_id, base=build)
                f.prepare_base()
                got = await f.obtain(anns[2])
                assert got.path == "full" and bytes(got.checkpoint.to_bytes()) == want, name
                assert not (tmp_path / name / BASE_FILE).exists()

            # Three versions on, the chain starts at the v3 anchor: version 0 is no use any more.
            ann3, _ = await pub.publish(3, {k: t * 1.001 for k, t in v2.items()})
            assert ann3.full_version == 3
            fd = _follower(tmp_path, "d", d, trainer.key.peer_id, base=local)
            fd.prepare_base()
            got = await fd.obtain(ann3)
            assert got.path == "full" and got.version == 3
            await wait_until(lambda: not (tmp_path / "d" / BASE_FILE).exists(), 30, what="base gone")
        finally:
            for p in peers:
                await p.stop()

    asyncio.run(main())
