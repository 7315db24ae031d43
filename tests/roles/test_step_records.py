"""The trainer's signed step records: they verify, chain to the announced policies, and replay to them.

A trainer, a validator and one worker on the embedded model train a few steps in one process
(``intellect_node.testing.roles``); then, from the trainer's records (``trainer/records/<seq>.rec``) and
the batches they name alone:

- the worker's ledger holds a receipt for each of its batches a record names (trained at which version,
  or dropped and why), and lists its trained rollouts from the records alone;
- every record verifies as the run trainer's, for the run, and they chain: each starts where the previous
  one ended, the first at version 0, and each trained version's hash is the one the worker heard announced;
- an audit of the whole window from version 0 (``roles/auditor/replay.py``), on the CPU with one thread,
  replays every step to the published hash bit for bit;
- a trainer that trained with another learning rate than the one it states, or that left out a group
  with a signal, fails that step's audit; a missing batch makes the audit ``unavailable``, never a pass.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from intellect_node.config import NodeConfig
from intellect_node.config.ledger import BatchRow, Ledger
from intellect_node.fsutil import read_jsonl
from intellect_node.protocol.steps import StepRecord, open_record
from intellect_node.roles.auditor.inputs import batch_groups, run_rescorer, run_settings
from intellect_node.roles.auditor.replay import StepAudit, audit_window
from intellect_node.roles.common.models import model_dir
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from intellect_node.trainer.model import TrainOptions, load_trainable
from tests.support.wait import wait_until

pytestmark = [pytest.mark.timeout(900)]

LR = 1e-3
RL = dict(group_size=8, problems_per_batch=2, groups_per_step=2, max_new_tokens=5, batches_per_version=2,
          checkpoint_every=1000, ban_after=1000, lr=LR)
TRAINED = 3  # trained steps before the run stops


def _records(tdir: Path, trainer: str) -> list[StepRecord]:
    recs = [open_record(p.read_bytes(), run_id="e2e", trainer=trainer)
            for p in sorted((tdir / "records").glob("*.rec"))]
    return sorted(recs, key=lambda r: r.seq)


def _announced(wdir: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for h in read_jsonl(wdir / "worker" / "hops.jsonl"):
        version = h.get("version")
        if h.get("event") == "announced" and isinstance(version, int):
            out.setdefault(version, set()).add(str(h["hash"]))
    return out


def _receipts(wdir: Path) -> dict[str, BatchRow]:
    """The worker's recent batches that a step record named, by batch CID."""
    with Ledger.in_data_dir(wdir, readonly=True) as led:
        return {str(r["batch_id"]): r for r in led.recent(10_000) if r["trained_outcome"] is not None}


def _audit(tmp: Path, cfg: NodeConfig, recs: list[StepRecord], lr: float | None = None,
           drop: frozenset[str] = frozenset()) -> list[StepAudit]:
    torch.set_num_threads(1)  # as the trainer runs
    model = load_trainable(model_dir(cfg), TrainOptions.from_section(cfg.rl))
    inbox = tmp / "trainer" / "trainer" / "inbox"

    def fetch(cid: str) -> bytes | None:
        path = inbox / f"{cid}.batch"
        return None if cid in drop or not path.exists() else path.read_bytes()

    settings = run_settings(cfg)
    if lr is not None:  # the trainer states this learning rate (and the run's config says so too)
        settings = msgspec.structs.replace(settings, lr=lr)
        recs = [msgspec.structs.replace(r, settings=settings) for r in recs]
    return audit_window(model, recs, batch_groups(run_rescorer(cfg), fetch), settings=settings)


def test_step_records_verify_chain_and_replay(tmp_path: Path) -> None:
    tdir = tmp_path / "trainer" / "trainer"
    trainer_id, w1 = key_of("trainer").peer_id, key_of("w1").peer_id
    cfg = run_config(trainer=trainer_id, validators=[key_of("validator").peer_id], rl=RL, run_id="e2e")

    def trained() -> int:
        return sum(1 for r in _records(tdir, trainer_id) if r.trained)

    async def main() -> dict[str, tuple[StepRecord, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            await net.start("validator", cfg, Validator.for_runtime)
            await net.start("w1", cfg, Worker.for_runtime)
            await wait_until(lambda: trained() >= TRAINED, timeout=600,
                             what=f"{TRAINED} trained steps recorded")
            newest = max(r.version for r in _records(tdir, trainer_id))
            await wait_until(lambda: newest in _announced(tmp_path / "w1"), timeout=120,
                             what=f"v{newest} heard by the worker")
            st = trainer.status()
            assert st["records"]["published"] >= TRAINED
            assert st["records"]["last"]["cid"], st["records"]

            # Receipts: the worker's ledger holds what the records say of each of its batches.
            named = {b.cid: (r, b) for r in _records(tdir, trainer_id) for b in (*r.batches, *r.stale)}
            await wait_until(lambda: set(named) <= set(_receipts(tmp_path / "w1")), timeout=120,
                             what="every recorded batch in the worker's ledger")
            receipts = _receipts(tmp_path / "w1")
            for cid, (rec, b) in named.items():
                outcome = "stale" if b in rec.stale else "trained" if b.trained else "equal_rewards"
                assert receipts[cid]["trained_outcome"] == outcome
                if outcome == "trained":
                    assert receipts[cid]["trained_version"] == rec.version
            assert not net.failures(), net.failures()
            return named

    named = asyncio.run(main())
    # Every worker's trained rollouts from the records alone: those heard before the stop, at least all
    # that were on disk when the receipts were checked (more steps may have been taken since).
    with Ledger.in_data_dir(tmp_path / "w1", readonly=True) as led:
        by_worker = led.trained_by_worker(run_id="e2e")
    assert [w["worker"] for w in by_worker] == [w1]

    def rollouts(recs: list[StepRecord]) -> int:
        return sum(len(b.trained) * int(RL["group_size"]) for r in recs for b in r.batches)

    assert rollouts(list({r.seq: r for r, _ in named.values()}.values())) <= by_worker[0]["rollouts_trained"]
    assert by_worker[0]["rollouts_trained"] <= rollouts(_records(tdir, trainer_id))

    recs = _records(tdir, trainer_id)
    # Stopped between a step and its record's file, the newest may be missing: take the prefix on disk.
    recs = [r for i, r in enumerate(recs) if r.seq == i + 1]
    assert sum(r.trained for r in recs) >= TRAINED

    # The records chain from v0 to the announced versions.
    assert recs[0].base_version == 0
    heard = _announced(tmp_path / "w1")
    for prev, rec in zip(recs, recs[1:]):
        assert rec.base_hash == prev.checkpoint_hash and rec.base_version == prev.version
    for rec in recs:
        assert all(b.worker == w1 for b in rec.batches)
        if rec.trained and rec.version in heard:
            assert heard[rec.version] == {rec.checkpoint_hash}, rec.version

    # An honest trainer's window replays bit for bit.
    honest = _audit(tmp_path, cfg, recs)
    assert [a.outcome for a in honest] == ["pass"] * len(recs), honest
    assert [a.expected for a in honest] == [r.checkpoint_hash for r in recs]

    # Trained with the run's learning rate while stating another: caught at the first trained step.
    first = next(i for i, r in enumerate(recs) if r.trained)
    lied = _audit(tmp_path, cfg, recs, lr=LR / 2)
    assert [a.outcome for a in lied[:first + 1]] == ["pass"] * first + ["fail"], lied
    assert lied[first].expected != lied[first].published
    assert all(a.outcome == "unavailable" for a in lied[first + 1:])

    # A group with a signal left out of what the record says was trained: caught without training.
    rec = recs[first]
    b0 = rec.batches[next(i for i, b in enumerate(rec.batches) if b.trained)]
    fewer = msgspec.structs.replace(b0, trained=b0.trained[1:])
    forged: StepRecord = msgspec.structs.replace(
        rec, batches=[fewer if b is b0 else b for b in rec.batches])
    dropped = _audit(tmp_path, cfg, [*recs[:first], forged, *recs[first + 1:]])
    assert dropped[first].outcome == "fail" and "unequal rewards" in dropped[first].reason, dropped[first]

    # A batch that cannot be had: unavailable, never a pass.
    missing = _audit(tmp_path, cfg, recs, drop=frozenset({b0.cid}))
    assert missing[first].outcome == "unavailable" and b0.cid in missing[first].reason

