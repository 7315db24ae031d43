"""A window's start state is fetched at the sizes the run's model gives it, into a file that is mapped.

In process, with real parts: a trainer's blob peer and an auditor's on 127.0.0.1 (real HTTP), the
auditor's real :class:`HintedFetcher` and :class:`ChainAuditor` (on the package's fake swarm, which keeps
what it publishes and the rejections recorded):

- :class:`StateSizes` from the embedded model: the weights file's size exactly, the optimizer state's
  exactly once every parameter took a step, a state of fewer parameters smaller;
- a weights blob one byte larger than the model's file is refused on its manifest: not one chunk of it
  reaches the auditor's store (the trainer serves it in chunks of 256 KiB); the exact one is fetched into
  a file, mapped, and is the trainer's weights;
- the chain auditor's window from such a start fails (the trainer signed that blob), with both sizes in
  the reason, recorded against the trainer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.blobs.peer import BlobPeer, mesh
from intellect_node.config import NodeConfig
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.audits import open_verdict
from intellect_node.protocol.steps import StepRecord, StepState
from intellect_node.roles.auditor.chain import ChainAuditor
from intellect_node.roles.auditor.published import StateSizes, fetch_mapped
from intellect_node.roles.auditor.windows import Start
from intellect_node.roles.common.fetch import HintedFetcher, WrongSize
from intellect_node.testing.roles import FakeSwarm
from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.optstate import encode_optimizer
from intellect_node.trainer.step import make_optimizer, train_step
from tests.roles.test_audit_tolerance import GCFG, LR, SETTINGS, STEPS

RUN = "sizes"
CHUNK = 256 << 10  # the smallest chunk a fetch under a budget takes: many chunks for the embedded model


def _trained() -> tuple[Any, Any]:
    torch.set_num_threads(1)
    model = load_trainable(None)
    opt = make_optimizer(model, LR)
    train_step(model, opt, [s for g in STEPS[0] for s in g], GCFG, pack=False)
    return model, opt


def test_sizes_come_from_the_model() -> None:
    model, opt = _trained()
    sizes = StateSizes.of(load_trainable(None))  # from the layout alone: a fresh copy of the model
    assert sizes.weights == PolicyWeights.from_state_dict(model.state_dict()).nbytes
    assert sizes.optimizer == encode_optimizer(opt).nbytes  # every parameter took the step
    opt.state.pop(next(iter(opt.state)))  # a parameter that never had a gradient has no state
    assert encode_optimizer(opt).nbytes < sizes.optimizer


async def _peers(tmp: Path) -> tuple[BlobPeer, BlobPeer]:
    trainer, auditor = [await BlobPeer(tmp / name).start() for name in ("trainer", "auditor")]
    mesh([trainer, auditor])
    return trainer, auditor


def _swarm(auditor: BlobPeer, trainer: BlobPeer) -> FakeSwarm:
    swarm = FakeSwarm(auditor.key)
    swarm.peerbook._urls = lambda p: trainer.url if p == trainer.key.peer_id else ""
    return swarm


async def _put(peer: BlobPeer, path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return (await peer.blobs.put_file(path, chunk_size=CHUNK))[0]


def test_a_start_blob_one_byte_larger_is_refused_before_any_chunk(tmp_path: Path) -> None:
    model, _ = _trained()
    weights = PolicyWeights.from_state_dict(model.state_dict())
    sizes = StateSizes.of(model)

    async def main() -> tuple[Any, ...]:
        trainer, auditor = await _peers(tmp_path)
        fetcher = HintedFetcher(auditor.blobs, _swarm(auditor, trainer))
        try:
            honest = await _put(trainer, tmp_path / "w.bin", bytes(weights.to_bytes()))
            larger = await _put(trainer, tmp_path / "w1.bin", bytes(weights.to_bytes()) + b"\0")
            chunks = trainer.blobs.store.manifest(larger).chunks  # type: ignore[union-attr]
            with pytest.raises(WrongSize) as info:
                await fetch_mapped(fetcher, larger, tmp_path / "out" / "w1", holders=[trainer.key.peer_id],
                                   max_size=sizes.weights, size=sizes.weights, timeout=30)
            store = auditor.blobs.store
            left = (store.manifest(larger), [c for c in chunks if store.has_chunk(c)],
                    (tmp_path / "out" / "w1").exists())
            got = await fetch_mapped(fetcher, honest, tmp_path / "out" / "w", holders=[trainer.key.peer_id],
                                     max_size=sizes.weights, size=sizes.weights, timeout=30)
            return str(info.value), len(chunks), left, got.content_hash, (tmp_path / "out" / "w").exists()
        finally:
            fetcher.close()
            await trainer.stop()
            await auditor.stop()

    why, n_chunks, left, got_hash, file_left = asyncio.run(main())
    assert n_chunks > 4
    assert f"holds {sizes.weights + 1} bytes, {sizes.weights} expected" in why
    assert left == (None, [], False)  # refused on its manifest: no chunk fetched, nothing kept
    assert got_hash == weights.content_hash and not file_left  # mapped; its name removed at once


def test_the_chain_auditor_fails_a_start_of_the_wrong_size(tmp_path: Path) -> None:
    model, opt = _trained()
    weights = PolicyWeights.from_state_dict(model.state_dict())
    optimizer = encode_optimizer(opt)
    sizes = StateSizes.of(model)

    async def main() -> tuple[Any, ...]:
        trainer, auditor = await _peers(tmp_path)
        tid = trainer.key.peer_id
        swarm = _swarm(auditor, trainer)
        fetcher = HintedFetcher(auditor.blobs, swarm)
        cfg = NodeConfig.model_validate({"run": {"run_id": RUN, "trainer_peer_id": tid,
                                                 "validator_peer_ids": [auditor.key.peer_id]},
                                         "validator": {"audit": True}})
        chain = ChainAuditor(cfg, swarm=swarm, fetcher=fetcher, trainer=tid,
                             directory=tmp_path / "audit")
        chain.start()
        try:
            larger = await _put(trainer, tmp_path / "w1.bin", bytes(weights.to_bytes()) + b"\0")
            opt_cid = await _put(trainer, tmp_path / "o.bin", bytes(optimizer.to_bytes()))
            rec = StepRecord(run_id=RUN, seq=1, step=1, base_version=0, base_hash=weights.content_hash,
                             version=1, checkpoint_hash=weights.content_hash, batches=[], settings=SETTINGS,
                             state=StepState(weights_cid=larger, optimizer_cid=opt_cid,
                                             optimizer_hash=optimizer.content_hash))
            chain._sizes = chain.published.sizes = sizes  # what run() sets once it loaded the model
            await chain._open(load_trainable(None), Start(first=2, record=rec))
            return chain.windows, swarm.published, swarm.peerbook.rejections, tid
        finally:
            fetcher.close()
            await trainer.stop()
            await auditor.stop()

    windows, published, rejections, tid = asyncio.run(main())
    assert windows["fail"] == 1 and windows["audited"] == 1, windows
    (_, raw), = published
    verdict, _ = open_verdict(raw, run_id=RUN, auditors=None)
    assert verdict.outcome == "fail" and verdict.seq == 1, verdict
    assert f"holds {sizes.weights + 1} bytes, {sizes.weights} expected" in verdict.reason
    assert [p for p, _ in rejections] == [tid] and "window start v1" in rejections[0][1]
