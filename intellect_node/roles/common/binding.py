"""One hash per policy version, checked by every node: :class:`HashBook` and :class:`BindingWatch`.

Workers load the policy the trainer announces; auditors replay the steps its records describe. Nothing
else ties the two, so a trainer could audit clean on an honest shadow chain of records while it announces
other weights. Every version's hash is signed twice over, though (``protocol/binding.py``), and an
honest trainer signs one hash per version. The node's :class:`~intellect_node.roles.common.audits.
AuditWatch` runs a :class:`BindingWatch` that:

1. reads every policy announcement and step record of the run's trainer the node hears, with the
   envelope as received, into a :class:`HashBook` (a pure, bounded state machine): the first hash heard
   for each version and the envelope that signed it. The watch's validators on the ``policy`` and
   ``steps`` topics are the topics' first (the audit watch is a common service, started before the
   roles), so they are the ones the swarm runs (one validator per topic): each opens the message exactly
   as the roles' own validators do (``open_announcement``, ``open_record``) and hands the roles the same
   decoded message;
2. when a message binds a version to another hash than the one held, has the proof
   (``HashConflict``: the two envelopes), keeps it (``<data-dir>/audits/<run>/evidence/
   v<version>.conflict``, written atomically, and ``v<version>.json`` with both hashes) and gossips it on
   the run's ``conflicts`` topic, so that a node that heard only one of the two learns it;
3. takes proofs from that topic only after checking them itself (``open_conflict``: both envelopes the
   trainer's, of this run, binding the version to two hashes); a forged one is refused in the gossip
   validator and the reason recorded against the peer that sent it, as on every topic, and changes
   nothing here;
4. tells the audit watch (``on_proof``): the trainer failed an audit, whoever found it, and with
   ``run.require_audits`` the node stops following it. At start the proofs kept are checked again and
   read back, so a restarted node still refuses that trainer.

Bounds: the book holds the newest :data:`MAX_VERSIONS` versions and at most :data:`MAX_BOOK_BYTES` of
envelopes (counted once per version they bind: an overcount), forgetting the oldest versions first;
:data:`MAX_PROOFS` proofs are kept (the first ones). Shortcuts: a conflict about a version older than
what the book holds is not seen; a proof over the gossip layer's message limit (two large records) is
kept and acted on here but not gossiped (others find it themselves when they heard both halves); a
proof is gossiped once, when found, so a node that joins later learns it only from the trainer's
messages themselves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from intellect_node.errors import IntellectNodeError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes, atomic_write_text
from intellect_node.protocol.binding import (
    CONFLICT_KIND,
    MAX_CONFLICT_BYTES,
    HashConflict,
    announcement_bindings,
    conflict_validator,
    open_conflict,
    record_bindings,
    seal_conflict,
)
from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement, open_announcement
from intellect_node.protocol.steps import STEP_KIND, StepRecord, open_record
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.seams import Runtime

log = logging.getLogger(__name__)

MAX_VERSIONS = 8192
"""Versions whose first hash heard is held (a conflict about an older one is not seen)."""
MAX_BOOK_BYTES = 64 << 20
"""Envelope bytes the book holds at most (each counted once per version it binds)."""
MAX_PROOFS = 16
"""Proofs kept (the first ones found or heard): one is all a refusal needs."""


@dataclass(frozen=True)
class Held:
    """The first hash heard for a version and the envelope that signed it."""

    hash: str
    envelope: bytes


class HashBook:
    """The hash each version was first bound to, with its envelope (no I/O, no clock; thread-safe: the
    gossip validators feed it from the swarm's thread)."""

    def __init__(self, *, max_versions: int = MAX_VERSIONS, max_bytes: int = MAX_BOOK_BYTES) -> None:
        self._max_versions = max_versions
        self._max_bytes = max_bytes
        self._held: dict[int, Held] = {}
        self._bytes = 0
        self._floor = -1  # versions at or below it were let go
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, envelope: bytes, binds: Mapping[int, str]) -> tuple[int, Held] | None:
        """Note what ``envelope`` (opened and checked by the caller) binds; the first version it binds to
        another hash than the one held, with what is held, or None."""
        with self._lock:
            conflict: tuple[int, Held] | None = None
            for version, h in sorted(binds.items()):
                if version <= self._floor:
                    continue
                held = self._held.get(version)
                if held is None:
                    self._held[version] = Held(h, envelope)
                    self._bytes += len(envelope)
                elif held.hash != h and conflict is None:
                    conflict = (version, held)
            while self._held and (len(self._held) > self._max_versions or self._bytes > self._max_bytes):
                oldest = min(self._held)
                self._bytes -= len(self._held.pop(oldest).envelope)
                self._floor = max(self._floor, oldest)
            return conflict


@dataclass(frozen=True)
class Proof:
    """A hash conflict checked here: the proof's bytes, its version and hashes, who found or sent it."""

    conflict: HashConflict
    hashes: tuple[str, str]
    data: bytes
    source: str  # "found here", or the peer it came from
    received_at: float

    def to_json(self) -> str:
        c = self.conflict
        return json.dumps({"run_id": c.run_id, "version": c.version, "hashes": list(self.hashes),
                           "source": self.source, "received_at": self.received_at,
                           "proof": f"v{c.version}.conflict"}, indent=1, sort_keys=True)

    def describe(self) -> str:
        a, b = self.hashes
        return f"the trainer signed two checkpoint hashes for v{self.conflict.version}: {a} and {b}"


def read_proofs(directory: Path, *, run_id: str, trainer: str) -> tuple[list[Proof], list[str]]:
    """The proofs kept in ``directory`` that still hold (each checked again); ``(proofs, why each other
    file was left out)``."""
    found: list[Proof] = []
    skipped: list[str] = []
    if not directory.is_dir():
        return found, skipped
    for path in sorted(directory.glob("v*.conflict"))[:MAX_PROOFS]:
        try:
            data = path.read_bytes()[:MAX_CONFLICT_BYTES + 1]
            c, hashes = open_conflict(data, run_id=run_id, trainer=trainer)
            doc = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError, ProtocolError) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        at = doc.get("received_at") if isinstance(doc, dict) else None
        src = doc.get("source") if isinstance(doc, dict) else None
        found.append(Proof(c, hashes, data, str(src or "kept"), float(at) if isinstance(at, (int, float))
                           else 0.0))
    return found, skipped


OnProof = Callable[[Proof], Awaitable[None]]


class BindingWatch:
    """Hash conflicts of the run's trainer on this node (see the module docstring); ``on_proof`` is
    awaited once per proof taken (found here, heard and checked, or read back at start)."""

    def __init__(self, runtime: Runtime, directory: Path, trainer: str, on_proof: OnProof, *,
                 on_record: Callable[[StepRecord], None] | None = None) -> None:
        self._rt = runtime
        self.run_id = runtime.config.run.run_id
        self.trainer = trainer
        self.dir = directory
        self.book = HashBook()
        self.proofs: dict[int, Proof] = {}  # version -> the proof taken
        self.counts = {"announcements": 0, "records": 0, "found": 0, "heard": 0, "not_gossiped": 0}
        self._on_proof = on_proof
        self._on_record = on_record
        self._found: list[HashConflict] = []  # found by the validators (swarm thread), taken by handlers
        self._found_lock = threading.Lock()

    async def start(self) -> None:
        found, skipped = await asyncio.to_thread(read_proofs, self.dir, run_id=self.run_id,
                                                 trainer=self.trainer)
        for why in skipped:
            log.warning("hash conflict evidence left out: %s", why)
        for p in found:
            await self._take(p, keep=False)
        swarm = self._rt.swarm
        swarm.subscribe(topic(self.run_id, POLICY_KIND), self._validate_announcement, self._drain,
                        include_own=True)
        swarm.subscribe(topic(self.run_id, STEP_KIND), self._validate_record, self._on_step, include_own=True)
        swarm.subscribe(topic(self.run_id, CONFLICT_KIND), conflict_validator(self.run_id, self.trainer),
                        self._on_conflict, include_own=True)

    # -- the gossip validators (the swarm's thread) ------------------------------------------------

    def _validate_announcement(self, data: bytes, origin: str) -> PolicyAnnouncement:
        ann = open_announcement(data, run_id=self.run_id, trainer=self.trainer)
        self.counts["announcements"] += 1
        self._note(data, announcement_bindings(ann))
        return ann

    def _validate_record(self, data: bytes, origin: str) -> StepRecord:
        rec = open_record(data, run_id=self.run_id, trainer=self.trainer)
        self.counts["records"] += 1
        self._note(data, record_bindings(rec))
        return rec

    def _note(self, data: bytes, binds: Mapping[int, str]) -> None:
        got = self.book.add(data, binds)
        if got is not None:
            version, held = got
            with self._found_lock:
                self._found.append(HashConflict(run_id=self.run_id, version=version, first=held.envelope,
                                                second=data))

    # -- the handlers (the event loop) --------------------------------------------------------------

    async def _on_step(self, rec: StepRecord, origin: str) -> None:
        """After a step record: ``on_record`` (the audit coverage), then what the validators found."""
        if self._on_record is not None:
            self._on_record(rec)
        await self._drain(rec, origin)

    async def _drain(self, msg: object, origin: str) -> None:
        """After an announcement or record: act on what the validators found."""
        with self._found_lock:
            found, self._found = self._found, []
        for c in found:
            if c.version in self.proofs:
                continue
            try:
                data = seal_conflict(c, trainer=self.trainer)
                hashes = open_conflict(data, run_id=self.run_id, trainer=self.trainer)[1]
            except ProtocolError as exc:  # the book's own finding, checked like anyone's: a bug if it fails
                log.error("hash conflict about v%d does not check: %s", c.version, exc)
                continue
            self.counts["found"] += 1
            await self._take(Proof(c, hashes, data, "found here", time.time()))
            try:
                await self._rt.swarm.publish(topic(self.run_id, CONFLICT_KIND), data)
            except IntellectNodeError as exc:  # over the gossip limit: kept and acted on here only
                self.counts["not_gossiped"] += 1
                log.warning("hash conflict about v%d not gossiped (%d bytes): %s", c.version, len(data), exc)

    async def _on_conflict(self, msg: tuple[HashConflict, tuple[str, str], bytes], origin: str) -> None:
        c, hashes, data = msg
        if c.version in self.proofs:
            return
        self.counts["heard"] += 1
        await self._take(Proof(c, hashes, data, origin, time.time()))

    async def _take(self, p: Proof, *, keep: bool = True) -> None:
        version = p.conflict.version
        if version in self.proofs or len(self.proofs) >= MAX_PROOFS:
            return
        self.proofs[version] = p
        if keep:
            try:
                await asyncio.to_thread(self._keep, p)
            except OSError as exc:  # it still counts here: a full disk must not hide it
                log.error("could not keep the hash conflict about v%d in %s: %s; a restart will not "
                          "remember it", version, self.dir, exc)
        await self._on_proof(p)

    def _keep(self, p: Proof) -> None:
        version = p.conflict.version
        atomic_write_bytes(self.dir / f"v{version}.conflict", p.data)
        atomic_write_text(self.dir / f"v{version}.json", p.to_json())

    def first(self) -> Proof | None:
        """The proof about the lowest version taken (what a refusal names)."""
        return self.proofs[min(self.proofs)] if self.proofs else None

    def status(self) -> dict[str, object]:
        return {**self.counts, "versions_held": len(self.book),
                "proofs": {str(v): {"hashes": list(p.hashes), "source": p.source}
                           for v, p in sorted(self.proofs.items())}}
