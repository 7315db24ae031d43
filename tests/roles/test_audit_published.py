"""Audits within a tolerance get the published weights through the swarm's blobs (``published.py``).

In process, with real parts: a trainer's blob peer and an auditor's on 127.0.0.1 (real HTTP), the
trainer's real :class:`PolicyPublisher` (deltas, anchors, signed announcements opened by the gossip
validator), the checkpoint's weights and optimizer blobs, the auditor's real :class:`HintedFetcher`, and
the replay in a worker thread asking the event loop for the published weights, as the chain auditor runs
it. The differing condition is the one ``test_audit_tolerance.py`` uses: the trainer trains with padded
rows, the auditor replays with each group's prompt shared (the same sums up to float rounding).

- an honest trainer: bitwise, the auditor fails its first step; with the calibrated tolerance every step
  passes, each step's weights made from the announced delta and the held base, and at the checkpoint the
  published optimizer state is within the tolerance too;
- a trainer whose learning rate is 10% above what its records state fails its first step;
- a trainer that publishes an optimizer state its steps did not make fails at its checkpoint;
- nothing announced and no blob named: ``unavailable``, never a pass; a checkpointed step's weights come
  from its full weights blob when no delta is known, an anchor's from the announced full blob when its
  delta does not apply; a blob nobody holds is ``PublishedUnavailable`` with why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.blobs.fetch import Provider
from intellect_node.blobs.peer import BlobPeer, mesh
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.policy import announcement_validator
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.steps import StepBatch, StepRecord, StepState
from intellect_node.roles.auditor.published import PublishedPolicy, PublishedUnavailable, StateSizes
from intellect_node.roles.auditor.replay import StepAudit, WindowReplay, weights_hash
from intellect_node.roles.auditor.tolerance import calibrate
from intellect_node.roles.auditor.windows import check_end
from intellect_node.roles.common.fetch import HintedFetcher
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.optstate import encode_optimizer
from intellect_node.trainer.step import make_optimizer, train_step
from tests.roles.test_audit_tolerance import GCFG, LR, SETTINGS, STEPS, _auditor_replays, _state

RUN = "published"
SIZES = StateSizes.of(load_trainable(None))  # what the run's model makes the published files measure
CHECKPOINT_SEQ = 2  # the step after which the trainer checkpoints (its record carries ``state``)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # as the trainer and the auditor run


@dataclass
class _Peerbook:
    """The part of the swarm's peer book a fetcher reads: the holders' HTTP addresses."""

    urls: dict[str, str]
    rejections: list[tuple[str, str]] = field(default_factory=list)

    def record_rejection(self, peer_id: str, reason: str, *, counts: bool = True) -> int:
        self.rejections.append((peer_id, reason))
        return len(self.rejections)

    def is_banned(self, peer_id: str) -> bool:
        return False

    def http_url(self, peer_id: str) -> str:
        return self.urls.get(peer_id, "")


class _Swarm:
    """What :class:`HintedFetcher` asks of the libp2p swarm: its peer ID, the peer book, the DHT (empty:
    the trainer, named as the holder, is the only source)."""

    def __init__(self, key: SigningKey, urls: dict[str, str]) -> None:
        self.peer_id = key.peer_id
        self.peerbook = _Peerbook(urls)

    async def find_providers(self, cid: str, *, count: int = 20) -> Sequence[Provider]:
        return []


@dataclass
class Chain:
    records: list[StepRecord]
    announcements: list[bytes]  # sealed, as gossiped
    trainer: str


async def _train_and_publish(tmp: Path, peer: BlobPeer, *, lr: float = LR,
                             optimizer_edit: Any = None) -> Chain:
    """The "trainer": each step of :data:`STEPS` with padded rows at ``lr`` (its records state
    :data:`SETTINGS`), each version published (deltas, an anchor every 3), and after step
    :data:`CHECKPOINT_SEQ` its weights and optimizer state put as blobs and named in the record
    (``optimizer_edit``: what it does to that state before publishing it)."""
    model = load_trainable(None)
    opt = make_optimizer(model, lr)
    pub = PolicyPublisher(tmp / "pub", peer.blobs, peer.key, RUN, full_every=3)
    announcements = [(await pub.publish(0, _state(model)))[1]]
    records = []
    for i, groups in enumerate(STEPS):
        seq, base_hash = i + 1, weights_hash(model)
        await asyncio.to_thread(train_step, model, opt, [s for g in groups for s in g], GCFG, pack=False)
        weights = PolicyWeights.from_state_dict(_state(model))
        announcements.append((await pub.publish(seq, weights))[1])
        state = None
        if seq == CHECKPOINT_SEQ:
            optimizer = encode_optimizer(opt)
            if optimizer_edit is not None:
                optimizer = PolicyWeights.from_state_dict(optimizer_edit(optimizer.to_state_dict()))
            cids = []
            for name, blob in (("weights", weights), ("optimizer", optimizer)):
                atomic_write_bytes(tmp / f"{name}.bin", bytes(blob.to_bytes()))
                cids.append((await peer.blobs.put_file(tmp / f"{name}.bin"))[0])
            state = StepState(weights_cid=cids[0], optimizer_cid=cids[1],
                              optimizer_hash=optimizer.content_hash)
        batch = StepBatch(cid=cid_of(f"batch {i}".encode()), worker="w", groups=len(groups),
                          trained=list(range(len(groups))))
        records.append(StepRecord(run_id=RUN, seq=seq, step=seq, base_version=i, base_hash=base_hash,
                                  version=seq, checkpoint_hash=weights.content_hash, batches=[batch],
                                  settings=SETTINGS, state=state))
    return Chain(records, announcements, peer.key.peer_id)


async def _peers(tmp: Path) -> tuple[BlobPeer, BlobPeer]:
    trainer, auditor = [await BlobPeer(tmp / name).start() for name in ("trainer", "auditor")]
    mesh([trainer, auditor])
    return trainer, auditor


def _files(auditor: BlobPeer) -> Path:
    """Where the auditor assembles the published files it maps (beside its store)."""
    return auditor.blobs.store.root.with_name("published")


def _published(auditor: BlobPeer, trainer: BlobPeer, fetcher_urls: bool = True) -> tuple[PublishedPolicy,
                                                                                         HintedFetcher]:
    swarm = _Swarm(auditor.key, {trainer.key.peer_id: trainer.url} if fetcher_urls else {})
    fetcher = HintedFetcher(auditor.blobs, swarm)  # type: ignore[arg-type]  # a stand-in for it
    return PublishedPolicy(fetcher, trainer.key.peer_id, _files(auditor), SIZES), fetcher


async def _audit(chain: Chain, published: PublishedPolicy, tolerance: float, *,
                 heard: bool = True) -> list[StepAudit]:
    """The chain auditor's replay of ``chain`` from version 0: the announcements heard (as the validator
    hands them on), each record replayed in a worker thread, the published weights and optimizer state
    asked of the event loop (``PublishedPolicy.blocking``)."""
    if heard:
        validate = announcement_validator(RUN, chain.trainer)
        for raw in chain.announcements:
            published.heard(validate(raw, chain.trainer))
    weights_of, optimizer_of = published.blocking(asyncio.get_running_loop())
    replay = WindowReplay(load_trainable(None), SETTINGS, tolerance=tolerance, published=weights_of)
    groups = {b.cid: STEPS[r.seq - 1] for r in chain.records for b in r.batches}
    out = []
    for rec in chain.records:
        def one(rec: StepRecord = rec) -> StepAudit:
            return check_end(replay, rec, replay.audit(rec, lambda b: groups[b.cid]), optimizer_of)
        out.append(await asyncio.to_thread(one))
    return out


@pytest.fixture(scope="module")
def tolerance() -> float:
    """Calibrated on the honest trainer's first two steps, as ``test_audit_tolerance.py`` does."""
    torch.set_num_threads(1)
    model = load_trainable(None)
    opt = make_optimizer(model, LR)
    states = [_state(model)]
    for groups in STEPS[:2]:
        train_step(model, opt, [s for g in groups for s in g], GCFG, pack=False)
        states.append(_state(model))
    return calibrate(_auditor_replays(states, STEPS[:2]), condition="padded -> packed").tolerance


def _run(coro_fn: Any, tmp: Path) -> Any:
    async def main() -> Any:
        trainer, auditor = await _peers(tmp)
        try:
            return await coro_fn(trainer, auditor)
        finally:
            await trainer.stop()
            await auditor.stop()
    return asyncio.run(main())


def test_an_honest_trainer_passes_within_the_tolerance_from_the_swarm(tmp_path: Path,
                                                                     tolerance: float) -> None:
    async def main(trainer: BlobPeer, auditor: BlobPeer) -> tuple[list[StepAudit], list[StepAudit], Any]:
        chain = await _train_and_publish(tmp_path, trainer)
        published, fetcher = _published(auditor, trainer)
        try:
            strict = await _audit(chain, published, 0.0)
            within = await _audit(chain, published, tolerance)
            return strict, within, dict(published.fetched)
        finally:
            fetcher.close()

    strict, within, fetched = _run(main, tmp_path)
    # Bitwise, the auditor's condition fails the honest trainer's first step (and fetched nothing).
    assert [a.outcome for a in strict] == ["fail"] + ["unavailable"] * (len(STEPS) - 1), strict
    # Within the tolerance every step passes, each from the delta the trainer announced, and the
    # checkpoint's optimizer state fetched and within the tolerance too.
    assert [a.outcome for a in within] == ["pass"] * len(STEPS), within
    assert all(a.reason.startswith("within tolerance") for a in within), within
    assert "optimizer state within tolerance" in within[CHECKPOINT_SEQ - 1].reason
    assert fetched == {"delta": len(STEPS), "full": 0, "optimizer": 1}


def test_a_learning_rate_other_than_stated_fails(tmp_path: Path, tolerance: float) -> None:
    async def main(trainer: BlobPeer, auditor: BlobPeer) -> list[StepAudit]:
        chain = await _train_and_publish(tmp_path, trainer, lr=LR * 1.1)  # the records state LR
        published, fetcher = _published(auditor, trainer)
        try:
            return await _audit(chain, published, tolerance)
        finally:
            fetcher.close()

    audits = _run(main, tmp_path)
    assert [a.outcome for a in audits] == ["fail"] + ["unavailable"] * (len(STEPS) - 1), audits
    assert "of its update" in audits[0].reason and audits[0].expected != audits[0].published


def test_an_optimizer_state_the_steps_did_not_make_fails_at_the_checkpoint(tmp_path: Path,
                                                                           tolerance: float) -> None:
    def doctored(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v * 0.5 if k.endswith("exp_avg") else v for k, v in state.items()}  # momentum halved

    async def main(trainer: BlobPeer, auditor: BlobPeer) -> list[StepAudit]:
        chain = await _train_and_publish(tmp_path, trainer, optimizer_edit=doctored)
        published, fetcher = _published(auditor, trainer)
        try:
            return await _audit(chain, published, tolerance)
        finally:
            fetcher.close()

    audits = _run(main, tmp_path)
    n = CHECKPOINT_SEQ
    assert [a.outcome for a in audits] == ["pass"] * (n - 1) + ["fail"] + ["unavailable"] * (len(STEPS) - n)
    assert "optimizer state published with" in audits[n - 1].reason and "of its norm" in audits[n - 1].reason


def test_published_weights_not_to_be_had_are_unavailable(tmp_path: Path, tolerance: float,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A blob nobody holds is looked for until the fetch's deadline: a short one here (the blobs the
    # trainer holds come well within it), shorter still while the test asks for the one nobody holds.
    deadline = "intellect_node.roles.auditor.published.FETCH_TIMEOUT_S"
    monkeypatch.setattr(deadline, 3.0)

    async def main(trainer: BlobPeer, auditor: BlobPeer) -> tuple[Any, ...]:
        chain = await _train_and_publish(tmp_path, trainer)
        published, fetcher = _published(auditor, trainer)
        try:
            # Nothing announced heard, and the first record names no blob: never a pass.
            audits = await _audit(chain, published, tolerance, heard=False)
            # The checkpointed step's weights from its own full weights blob (no delta known), checked.
            rec = chain.records[CHECKPOINT_SEQ - 1]
            got = await published.weights(rec, {})
            # A record naming a weights blob nobody holds: unavailable, with why.
            gone = StepRecord(**{**{f: getattr(rec, f) for f in rec.__struct_fields__},
                                 "state": StepState(weights_cid=cid_of(b"nobody holds this"),
                                                    optimizer_cid=rec.state.optimizer_cid,  # type: ignore[union-attr]  # set by now
                                                    optimizer_hash=rec.state.optimizer_hash)})  # type: ignore[union-attr]  # set by now
            monkeypatch.setattr(deadline, 0.5)
            with pytest.raises(PublishedUnavailable, match="not fetched") as info:
                await published.weights(gone, {})
            monkeypatch.setattr(deadline, 3.0)
            # An anchor's weights (v3, full_every 3) from the announced full blob when its delta does not
            # apply (here: handed no base), heard in the newest announcement alone.
            anchor = PublishedPolicy(fetcher, trainer.key.peer_id, _files(auditor), SIZES)
            anchor.heard(announcement_validator(RUN, chain.trainer)(chain.announcements[-1], chain.trainer))
            v3 = await anchor.weights(chain.records[2], {})
            return (audits, str(info.value), got.content_hash == rec.checkpoint_hash, dict(published.fetched),
                    v3.content_hash == chain.records[2].checkpoint_hash, dict(anchor.fetched))
        finally:
            fetcher.close()

    audits, why, full_is_published, fetched, anchor_is_published, anchor_fetched = _run(main, tmp_path)
    assert [a.outcome for a in audits] == ["unavailable"] * len(STEPS), audits
    assert "could not be had" in audits[0].reason
    assert full_is_published and fetched == {"delta": 0, "full": 1, "optimizer": 0}
    assert "nobody" not in why and "not fetched" in why
    assert anchor_is_published and anchor_fetched == {"delta": 0, "full": 1, "optimizer": 0}
