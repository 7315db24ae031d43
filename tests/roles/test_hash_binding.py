"""One checkpoint hash per policy version (``protocol/binding.py``, ``roles/common/binding.py``), as every
node's audit watch checks it, in this process with real keys and signed messages.

- the shadow-chain attack: a trainer whose records describe one chain (which an auditor's replay
  passes) and whose announcements name other weights for the same version is caught by a follower that
  heard both, and so is one that signs two announcements, or two records, for one version; the follower
  keeps the pair as evidence, gossips it, and with ``run.require_audits`` stops following the trainer
  (after a restart too);
- an honest trainer's messages (delta chains, anchors, no-signal records, repeats, any order) never are
  a conflict;
- a forged proof (a key that is not the trainer's, one message twice, two that agree, another run,
  garbage) is refused in the gossip validator and changes nothing; a real proof heard from another node
  counts once it is checked here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config import NodeConfig, build_config
from intellect_node.config.status import StatusBoard
from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.binding import CONFLICT_KIND, HashConflict, open_conflict
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.policy import (
    POLICY_KIND,
    DeltaLink,
    PolicyAnnouncement,
    open_announcement,
    seal_announcement,
)
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.steps import STEP_KIND, StepBatch, StepRecord, StepSettings, seal_record
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.audits import AuditWatch
from intellect_node.roles.common.binding import HashBook
from tests.support.peerbook import Peerbook

RUN = "bind"
TRAINER, AUDITOR, MALLORY, WORKER = (SigningKey(bytes([40 + i]) * 32) for i in range(4))
SETTINGS = StepSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, group_size=2, clip_eps_low=0.2,
                        clip_eps_high=0.2, neg_ratio_cap=1.0, max_grad_norm=1.0, token_budget=100,
                        kl_coef=0.0, entropy_coef=0.0, scale_by_std=True, temperature=1.0, micro_tokens=None,
                        compute_dtype=None)


def h(v: int, chain: str = "honest") -> str:
    """Version ``v``'s checkpoint hash on ``chain``."""
    return cid_of(f"{chain} weights v{v}".encode())


def announcement(v: int, chain: str = "honest", *, key: SigningKey = TRAINER, run_id: str = RUN,
                 full: int | None = None) -> bytes:
    """Version ``v`` announced with the delta links from its anchor ``full`` (default: v - 2, at least 0)."""
    full = max(0, v - 2) if full is None else full
    links = [DeltaLink(version=u, base_hash=h(u - 1, chain), target_hash=h(u, chain),
                       delta_cid=cid_of(f"delta {chain} {u}".encode()), delta_size=100)
             for u in range(full + 1, v + 1)]
    return seal_announcement(key, PolicyAnnouncement(
        run_id=run_id, version=v, dtype="F32", checkpoint_hash=h(v, chain), checkpoint_size=1000,
        full_version=full, full_cid=cid_of(f"full {chain} {full}".encode()), full_size=1000, deltas=links))


def record(seq: int, base: int, *, trained: bool = True, chain: str = "honest", base_chain: str | None = None,
           key: SigningKey = TRAINER) -> bytes:
    batch = StepBatch(cid=cid_of(f"batch {seq}".encode()), worker=WORKER.peer_id, groups=2,
                      trained=[0] if trained else [])
    version = base + 1 if trained else base
    return seal_record(key, StepRecord(
        run_id=RUN, seq=seq, step=seq, base_version=base, base_hash=h(base, base_chain or chain),
        version=version, checkpoint_hash=h(version, chain if trained else base_chain or chain),
        batches=[batch], settings=SETTINGS, no_signal="" if trained else "all_equal"))


class Swarm:
    """What the watch uses of a swarm: subscriptions (validator and handler kept), publications kept."""

    def __init__(self) -> None:
        self.peerbook = Peerbook()
        self.subscribed: dict[str, tuple[Any, Any]] = {}
        self.published: list[tuple[str, bytes]] = []

    def subscribe(self, name: str, validate: Any, handler: Any, *, include_own: bool = False) -> None:
        assert name not in self.subscribed, f"{name} subscribed twice"
        self.subscribed[name] = (validate, handler)

    async def publish(self, name: str, data: bytes) -> None:
        self.published.append((name, data))


class Runtime:
    def __init__(self, config: NodeConfig, data_dir: Path) -> None:
        self.config = config
        self.board = StatusBoard(role="worker")
        self.swarm = Swarm()
        self.data_dir = data_dir


def started(tmp: Path, *, require: bool = True) -> tuple[AuditWatch, Runtime]:
    cfg = build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                            "validator_peer_ids": [AUDITOR.peer_id], "require_audits": require})
    rt = Runtime(cfg, tmp)
    w = AuditWatch(rt)  # type: ignore[arg-type]  # the fake runtime has what the watch uses
    asyncio.run(w.start())
    return w, rt


def deliver(rt: Runtime, kind: str, data: bytes, origin: str = "12D3KooWforwarder") -> Any:
    """Through the topic's gossip validator (the watch's: the topic's first) then its handler, as the
    swarm would; what the validator decoded (what every other subscriber of the topic gets)."""
    validate, handler = rt.swarm.subscribed[topic(RUN, kind)]
    msg = validate(data, origin)
    asyncio.run(handler(msg, origin))
    return msg


# -- the attack, caught -------------------------------------------------------------------------------

ATTACKS = {
    # the shadow chain: records of the honest chain (an auditor's replay passes them), another v2 announced
    "announcement_vs_record": [(STEP_KIND, record(1, 0)), (STEP_KIND, record(2, 1)),
                               (POLICY_KIND, announcement(1)), (POLICY_KIND, announcement(2, "backdoor"))],
    "record_vs_announcement": [(POLICY_KIND, announcement(2, "backdoor")), (STEP_KIND, record(2, 1))],
    "two_announcements": [(POLICY_KIND, announcement(2)), (POLICY_KIND, announcement(2, "backdoor", full=2))],
    "two_records": [(STEP_KIND, record(1, 0)), (STEP_KIND, record(2, 1, chain="backdoor",
                                                                    base_chain="backdoor"))],
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_two_hashes_signed_for_one_version_fail_the_audit_everywhere(tmp_path: Path, attack: str) -> None:
    w, rt = started(tmp_path)
    for kind, data in ATTACKS[attack]:
        deliver(rt, kind, data)
    refusal = w.refusal()
    assert "the trainer signed two checkpoint hashes for v" in refusal and "run.require_audits" in refusal
    snap = rt.board.snapshot().audits
    assert snap.state == "failed" and snap.refusing and snap.first_failed is not None
    version = snap.first_failed.version
    assert {snap.first_failed.expected, snap.first_failed.published} == {h(version), h(version, "backdoor")}
    # the pair is the evidence: kept, and gossiped so that a node that heard one half learns it
    kept = tmp_path / "audits" / RUN / "evidence" / f"v{version}.conflict"
    assert kept.is_file()
    [(name, data)] = rt.swarm.published
    assert name == topic(RUN, CONFLICT_KIND) and data == kept.read_bytes()
    c, hashes = open_conflict(data, run_id=RUN, trainer=TRAINER.peer_id)
    assert c.version == version and set(hashes) == {h(version), h(version, "backdoor")}
    # a restarted node reads it back, checks it again and still refuses the trainer
    again, rt2 = started(tmp_path)
    assert "two checkpoint hashes" in again.refusal() and rt2.board.snapshot().audits.state == "failed"


def test_a_conflict_without_require_audits_is_shown_and_followed(tmp_path: Path) -> None:
    w, rt = started(tmp_path, require=False)
    for kind, data in ATTACKS["announcement_vs_record"]:
        deliver(rt, kind, data)
    assert w.refusal() == "" and rt.board.snapshot().audits.state == "failed"
    assert w.status()["bindings"]["found"] == 1


def test_the_roles_get_the_message_they_would_have_decoded(tmp_path: Path) -> None:
    """The watch's validators are the topics' first, so the roles subscribed after it get what they get."""
    _, rt = started(tmp_path)
    assert deliver(rt, POLICY_KIND, announcement(3)) == open_announcement(announcement(3), run_id=RUN,
                                                                          trainer=TRAINER.peer_id)
    assert isinstance(deliver(rt, STEP_KIND, record(1, 0)), StepRecord)
    with pytest.raises(ProtocolError, match="not the run's trainer"):
        deliver(rt, POLICY_KIND, announcement(3, key=MALLORY))


# -- an honest trainer, never flagged ---------------------------------------------------------------

def test_an_honest_trainers_messages_never_conflict(tmp_path: Path) -> None:
    w, rt = started(tmp_path)
    msgs = [(POLICY_KIND, announcement(0, full=0))]
    seq = 0
    for v in range(1, 9):  # every third version a step that trained nothing after it; anchors every 4
        seq += 1
        msgs.append((STEP_KIND, record(seq, v - 1)))
        if v % 3 == 0:
            seq += 1
            msgs.append((STEP_KIND, record(seq, v, trained=False)))
        msgs.append((POLICY_KIND, announcement(v, full=v - v % 4)))
    msgs.append((POLICY_KIND, announcement(8, full=8)))  # re-anchored: the same hash
    for kind, data in [*msgs, *reversed(msgs), *msgs]:  # gossip repeats and reorders
        deliver(rt, kind, data)
    assert w.refusal() == "" and rt.board.snapshot().audits.state == "unaudited"
    st = w.status()["bindings"]
    assert st["found"] == 0 and st["proofs"] == {} and st["versions_held"] == 9
    assert rt.swarm.published == []


# -- forged evidence, refused -----------------------------------------------------------------------

def _proof(first: bytes, second: bytes, version: int = 2, run_id: str = RUN) -> bytes:
    return codec.encode(HashConflict(run_id=run_id, version=version, first=first, second=second))


FORGED = {
    "mallory_signed_half": (_proof(announcement(2), announcement(2, "backdoor", key=MALLORY)),
                            "not the run's"),
    "mallory_signed_both": (_proof(record(2, 1, key=MALLORY), announcement(2, "backdoor", key=MALLORY)),
                            "not the run's trainer"),
    "same_message_twice": (_proof(announcement(2), announcement(2)), "the same message twice"),
    "agreeing_pair": (_proof(announcement(2), record(2, 1)), "no conflict"),
    "version_not_bound": (_proof(announcement(2), announcement(2, "backdoor", full=2), version=7),
                          "binds no hash to v7"),
    "other_run": (_proof(announcement(2), announcement(2, "backdoor", full=2), run_id="other"), "other"),
    "not_a_proof": (b"\x93garbage", ""),
    "a_verdict_inside": (_proof(announcement(2), b"\x01" * 64), ""),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_forged_evidence_is_refused_and_halts_nothing(tmp_path: Path, forgery: str) -> None:
    w, rt = started(tmp_path)
    data, why = FORGED[forgery]
    with pytest.raises(ProtocolError, match=why or None):
        deliver(rt, CONFLICT_KIND, data)
    assert w.refusal() == "" and rt.board.snapshot().audits.state == "unaudited"
    # kept on disk by someone else (a hostile file in the data dir): read back, checked, left out
    folder = tmp_path / "audits" / RUN / "evidence"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "v2.conflict").write_bytes(data)
    (folder / "v2.json").write_text("{}")
    again, _ = started(tmp_path)
    assert again.refusal() == ""


def test_a_proof_heard_from_another_node_counts_once_checked(tmp_path: Path) -> None:
    w, rt = started(tmp_path)
    real = _proof(announcement(2), announcement(2, "backdoor", full=2))
    deliver(rt, CONFLICT_KIND, real, origin="12D3KooWwhistleblower")
    assert "two checkpoint hashes for v2" in w.refusal()
    assert rt.swarm.published == []  # heard, not found here: gossip already carries it on
    deliver(rt, CONFLICT_KIND, real)  # a repeat changes nothing
    assert w.status()["bindings"]["heard"] == 1


# -- the book's bounds --------------------------------------------------------------------------------

def test_the_book_forgets_the_oldest_versions_first() -> None:
    book = HashBook(max_versions=4)
    for v in range(10):
        assert book.add(b"env %d" % v, {v: h(v)}) is None
    assert len(book) == 4
    assert book.add(b"late", {2: h(2, "backdoor")}) is None  # let go: not seen (the documented shortcut)
    got = book.add(b"other", {9: h(9, "backdoor")})
    assert got is not None and got[0] == 9 and got[1].envelope == b"env 9"
    small = HashBook(max_bytes=100)
    small.add(b"x" * 60, {1: h(1)})
    small.add(b"y" * 60, {2: h(2)})
    assert len(small) == 1


# -- a real honest trainer, restarted in the middle ------------------------------------------------

def _drifting() -> Any:
    """The real trainer on a "device" whose replay does not remake a step's weights bit for bit (the
    weights nudged after each replayed step), as non-deterministic kernels would."""
    import torch

    from intellect_node.roles.trainer.role import Trainer

    class Drifting(Trainer):
        _drift = False

        async def _step(self, taken: Any, stale: Any, entry: Any = None) -> Any:
            self._drift = entry is not None  # a journaled step taken again
            return await super()._step(taken, stale, entry)

        def _train(self, samples: Any, lr: float) -> Any:
            stats, snap = super()._train(samples, lr)
            if not self._drift:
                return stats, snap
            with torch.no_grad():
                next(self.model.parameters()).add_(1e-3)
            return stats, self._snapshot()

    return Drifting


@pytest.mark.parametrize("replay", ["bitwise", "drifting"])
def test_a_real_honest_trainer_is_never_flagged_across_a_restart(tmp_path: Path, replay: str) -> None:
    """In one process (``intellect_node.testing.roles``): the real trainer, validator and worker, and a
    node that runs only the audit watch with ``run.require_audits``. The trainer checkpoints every eighth
    version and is replaced after its fifth step, once its records were heard: it replays the journaled
    steps since its checkpoint and signs their records again (the same bytes), or, where the replay
    makes other weights (``drifting``), signs none of them and goes on as the version after the newest
    signed one. The watch hears every announcement and record and never finds two hashes for one
    version."""
    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.roles.validator.role import Validator
    from intellect_node.roles.worker.role import Worker
    from intellect_node.testing.roles import in_process_swarm, key_of, run_config
    from tests.support.wait import wait_until

    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
              work_ahead=1, checkpoint_every=8)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl,
                     require_audits=True)
    again = Trainer if replay == "bitwise" else _drifting()

    async def main() -> dict[str, Any]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            watcher = await net.start("watcher", cfg, AuditWatch)
            await net.start("validator", cfg, Validator.for_runtime)
            await net.start("w", cfg, Worker.for_runtime)
            await wait_until(lambda: trainer.role.version >= 5
                             and watcher.role.status()["bindings"]["records"] >= 5, timeout=300,
                             what="the trainer at v5, its records heard")
            trainer = await net.start("trainer", cfg, again)  # replaced: replays the steps since v0
            replayed = dict(trainer.role.replay)
            end = trainer.role.version + 3
            await wait_until(lambda: trainer.role.version >= end, timeout=300, what=f"the trainer at v{end}")
            await wait_until(lambda: watcher.role.status()["bindings"]["records"] >= end - 2, timeout=60,
                             what="the watcher hearing the records")
            assert not net.failures(), net.failures()
            withheld = getattr(trainer.role.records, "withheld", 0)
            return {**watcher.role.status(), "replayed": {**replayed, "withheld": withheld}}

    st = asyncio.run(main())
    done = st["replayed"]
    assert done["steps"] >= 1, done
    if replay == "bitwise":
        assert done["outcome"] in ("identical", "replayed") and done["withheld"] == 0, done
    else:
        # bumped past the newest version signed, or (replayed beyond it before the kill's last signature
        # went out) on to versions never signed: either way the re-made ones are not signed again
        assert done["outcome"] in ("bumped", "replayed") and done["withheld"] >= 1, done
    assert st["bindings"]["found"] == 0 and st["bindings"]["proofs"] == {}, st
    assert st["bindings"]["announcements"] >= 5 and not st["refusing"] and st["state"] != "failed", st
