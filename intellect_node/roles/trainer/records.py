"""The trainer's signed step records (``protocol/steps.py``): one per journaled step, out with its version.

:func:`build_record` says what a step took, from what the step itself used: the journal entry's sequence
number, the batches in their training order, which of their groups the online filter kept, the base and
new policy hashes and the step's settings (:func:`settings_of`). :class:`StepRecords` seals it with the
trainer's key and, as one of the role's jobs, writes it to ``trainer/records/<seq>.rec`` (atomically),
adds that file to the blob store (provided in the DHT) and gossips it on the run's ``steps`` topic.

A step after which the trainer checkpoints carries the state it checkpointed (``StepState``): the trainer
hands in the files (:meth:`StepRecords.state_files`: the checkpoint's canonical weights, linked, and the
optimizer state in the canonical encoding of ``trainer/optstate.py``, written before the next step moves
it), and the record's job adds both to the blob store (provided in the DHT) before it seals the record.
``records/states.json`` names the newest :data:`PINNED_STATES` such blobs: ``roles/common/pins.py`` keeps
them through garbage collection, so auditors can start windows there. Records go out in the order the
steps were taken (one job at a time), so a record is never heard before the one it follows.

A step replayed after a crash (``replay.py``) makes the same record again (same batches, same weights,
the same state blobs: the same bytes), so publishing it twice tells nobody anything new and contradicts
nothing. One version, one hash (``protocol/binding.py``: every node fails a trainer that signs two hashes
for one version): :class:`StepRecords` remembers what it and the newest announcement bound each recent
version to (:meth:`StepRecords.bound`; its own records read back at start) and never seals a record that
binds a version otherwise. A replay that did not remake a step's weights bit for bit (a device whose
kernels are not deterministic) leaves those records unsigned (``withheld``, logged; an auditor finds the
record missing: ``unavailable``) and goes on as the next version (``replay.py``). Shortcut: a record
whose job had not run when the trainer was killed is not published again once a checkpoint covers its
step.

Nothing here references the trainer: it hands in the swarm, the blob service, its key and the role's tasks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from intellect_node.errors import IntellectNodeError
from intellect_node.fsutil import atomic_write_bytes, atomic_write_text
from intellect_node.protocol.binding import record_bindings
from intellect_node.protocol.signing import SigningKey, open_envelope
from intellect_node.protocol.steps import (
    MAX_RECORD_BYTES,
    STEP_DOMAIN,
    DroppedBatch,
    StepBatch,
    StepRecord,
    StepSettings,
    StepState,
    check_record,
    seal_record,
)
from intellect_node.roles.common.pins import PINNED_STATES, TRAINER_STATES
from intellect_node.roles.common.seams import RoleSwarm, RoleTasks
from intellect_node.roles.trainer.batching import Accepted
from intellect_node.trainer.optim import Optimizer
from intellect_node.trainer.optstate import write_optimizer
from intellect_node.trainer.step import Sample

log = logging.getLogger(__name__)

RECORDS_DIR = "records"
STATES_FILE = TRAINER_STATES.name
"""``records/states.json``: the newest published checkpoint states, ``[{"version", "seq", "weights_cid",
"optimizer_cid", "step"}]`` (read by ``roles/common/pins.py``)."""
BOUND_VERSIONS = 4096
"""Versions whose signed hash is remembered (a replay goes back to the last checkpoint, far fewer)."""
READ_BACK_RECORDS = 256
"""Own records read back at start for what they bound (the newest ones)."""


@dataclass(frozen=True)
class StateFiles:
    """A checkpoint's state to publish with its step's record: files the record's job adds as blobs and
    then removes."""

    weights: Path
    optimizer: Path
    optimizer_hash: str


def build_record(*, run_id: str, seq: int, step: int, base: tuple[int, str], new: tuple[int, str],
                 taken: Sequence[Accepted], stale: Sequence[Accepted], useful: Sequence[Sequence[Sample]],
                 no_signal: str, settings: StepSettings, dropped: Sequence[DroppedBatch] = ()) -> StepRecord:
    """The record of one step: ``base``/``new`` are (version, checkpoint hash); ``useful`` the groups the
    online filter kept (the very group objects of ``taken``, in order); each taken batch with the sealed
    acceptances that admitted it; ``dropped``: the accepted batches not queued since the last record."""
    kept = {id(g) for g in useful}
    batches = [StepBatch(cid=a.cid, worker=a.worker, groups=len(a.groups),
                         trained=[i for i, g in enumerate(a.groups) if id(g) in kept],
                         evidence=list(a.evidence)) for a in taken]
    return StepRecord(run_id=run_id, seq=seq, step=step, base_version=base[0], base_hash=base[1],
                      version=new[0], checkpoint_hash=new[1], batches=batches,
                      stale=[StepBatch(cid=a.cid, worker=a.worker, groups=len(a.groups)) for a in stale],
                      no_signal=no_signal, settings=settings, dropped=list(dropped))


def _read_states(path: Path) -> list[dict[str, object]]:
    try:
        states = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("%s unreadable (%s): it is written again at the next checkpoint", path, exc)
        return []
    return [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []


class RecordBlobs(Protocol):
    """The part of the blob service records need (``blobs/service.BlobService.put_file``)."""

    async def put_file(self, path: str | Path, *, name: str | None = ...,
                       announce_min_chunks: int = ...) -> tuple[str, object]: ...


class StepRecords:
    """Seals and publishes each step's record on ``topic`` (the run's ``steps`` topic)."""

    def __init__(self, *, key: SigningKey, swarm: RoleSwarm, blobs: RecordBlobs, topic: str, directory: Path,
                 tasks: RoleTasks) -> None:
        self._key = key
        self._swarm = swarm
        self._blobs = blobs
        self._topic = topic
        self.dir = directory / RECORDS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self._tasks = tasks
        self.published = 0
        self.last: dict[str, object] = {}
        """The newest record published: seq, version, blob CID."""
        self._order = asyncio.Lock()
        self.states: list[dict[str, object]] = _read_states(self.dir / STATES_FILE)
        self.withheld = 0
        """Records not signed because they bound a version to another hash than the one signed before."""
        self._bound: dict[int, str] = {}  # version -> the hash signed for it (records, the announcement)
        for path in sorted(self.dir.glob("*.rec"))[-READ_BACK_RECORDS:]:
            try:
                rec, signer = open_envelope(path.read_bytes(), STEP_DOMAIN, StepRecord,
                                            max_size=MAX_RECORD_BYTES)
            except (OSError, IntellectNodeError) as exc:
                log.warning("step record %s not read back: %s", path.name, exc)
                continue
            if signer == key.peer_id:
                self.bound(record_bindings(rec))

    def newest_bound(self) -> tuple[int, str] | None:
        """The newest version signed so far (by a record read back or handed in) and its hash."""
        if not self._bound:
            return None
        v = max(self._bound)
        return v, self._bound[v]

    def newest_state_step(self, *, default: int) -> int:
        """The trained step of the newest state published (``records/states.json``); ``default`` when
        none names one (none published yet, or a file of the release before, which has no ``step``)."""
        steps = [step for s in self.states if isinstance(step := s.get("step"), int)]
        return max(steps, default=default)

    def bound(self, binds: Mapping[int, str]) -> None:
        """Versions signed to these hashes (the first one signed stays)."""
        for version, h in binds.items():
            self._bound.setdefault(version, h)
        while len(self._bound) > BOUND_VERSIONS:
            del self._bound[min(self._bound)]

    def status(self) -> dict[str, object]:
        return {"published": self.published, "withheld": self.withheld, "last": dict(self.last),
                "states": [s.get("version") for s in self.states]}

    def path(self, seq: int) -> Path:
        return self.dir / f"{seq:010d}.rec"

    def state_files(self, ckpt_dir: Path, version: int, opt: Optimizer) -> StateFiles:
        """The files of checkpoint ``ckpt_dir`` (version ``version``) to publish (worker thread, before the
        next step moves the optimizer): its weights linked (copied where links are not supported) and the
        optimizer state written canonically."""
        weights, optimizer = self.dir / f"state-v{version}.weights", self.dir / f"state-v{version}.optimizer"
        weights.unlink(missing_ok=True)
        try:
            os.link(ckpt_dir / "model.safetensors", weights)
        except OSError:
            shutil.copyfile(ckpt_dir / "model.safetensors", weights)
        return StateFiles(weights, optimizer, write_optimizer(optimizer, opt))

    def emit(self, rec: StepRecord, state: StateFiles | None = None) -> None:
        """Check ``rec`` now (a bad record is the trainer's bug: it raises here) and publish it as a job,
        with ``state`` added as blobs first when the step was checkpointed."""
        check_record(rec)
        self._tasks.job(self._publish(rec, state), f"step record {rec.seq}")

    async def _publish(self, rec: StepRecord, state: StateFiles | None) -> None:
        async with self._order:  # taken in the order the jobs were made: the order of the steps
            binds = record_bindings(rec)
            clash = {v: (self._bound[v], h) for v, h in binds.items() if self._bound.get(v, h) != h}
            if clash:
                self.withheld += 1
                v, (was, now) = min(clash.items())
                log.warning("step record %d not signed: it binds v%d to %s, signed as %s before (a replay "
                            "that did not remake the weights bit for bit); an auditor finds it missing",
                            rec.seq, v, now, was)
                return
            self.bound(binds)
            if state is not None:
                rec = await self._with_state(rec, state)
            raw = seal_record(self._key, rec)
            path = self.path(rec.seq)
            await asyncio.to_thread(atomic_write_bytes, path, raw)
            cid = ""
            try:
                cid, _ = await self._blobs.put_file(path, name=f"{rec.run_id}-step{rec.seq}.rec",
                                                    announce_min_chunks=0)
            except IntellectNodeError as exc:  # the gossip still goes out; the file stays for a later look
                log.warning("step record %d not stored as a blob: %s", rec.seq, exc)
            await self._swarm.publish(self._topic, raw)
            self.published += 1
            self.last = {"seq": rec.seq, "version": rec.version, "cid": cid}

    async def _with_state(self, rec: StepRecord, files: StateFiles) -> StepRecord:
        """``rec`` naming the state blobs (unchanged when they could not be stored: no window starts
        there)."""
        name = f"{rec.run_id}-v{rec.version}"
        try:
            w_cid, _ = await self._blobs.put_file(files.weights, name=f"{name}.weights")
            o_cid, _ = await self._blobs.put_file(files.optimizer, name=f"{name}.optimizer")
        except (IntellectNodeError, OSError) as exc:
            log.warning("checkpoint state of v%d not published: %s", rec.version, exc)
            return rec
        finally:
            files.weights.unlink(missing_ok=True)
            files.optimizer.unlink(missing_ok=True)
        entry = {"version": rec.version, "seq": rec.seq, "step": rec.step, "weights_cid": w_cid,
                 "optimizer_cid": o_cid}
        self.states = [*(s for s in self.states if s["seq"] != rec.seq), entry][-PINNED_STATES:]
        await asyncio.to_thread(atomic_write_text, self.dir / STATES_FILE, json.dumps(self.states))
        return msgspec.structs.replace(rec, state=StepState(weights_cid=w_cid, optimizer_cid=o_cid,
                                                            optimizer_hash=files.optimizer_hash))
