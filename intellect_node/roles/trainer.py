"""Trainer role: GRPO on accepted rollouts, bounded staleness, atomic policy publication, resume.

- **Inputs.** The trainer listens to verdicts from the run's validators (``run.validator_peer_ids``).
  ``run.verdict_quorum`` of them must accept a batch (default 1; a rejection that comes first refuses
  it, so one faulty validator can delay work but not get bad work trained on). Votes are counted per
  (worker, batch), so a peer naming someone else's batch in its own notice cannot get it refused.
  Admission fetches the batch blob, decodes it strictly, checks it is the named worker's and in whole
  groups, recomputes every reward from the task (claimed rewards are never used), and *persists* it to
  ``trainer/inbox`` before queueing it. A verdict carrying ``ban`` bans the worker here too, so its
  later notices and verdict replays are dropped at the gossip validator. In a closed run
  (``run.worker_allowlist``) other workers' batches are refused (``not_allowed``).
- **Each rollout once.** A batch holding a rollout already admitted (same run, version, worker, problem
  and sample index, or rollout ID; ``roles/admission.py``) is refused as ``duplicate`` whatever its blob
  CID, recorded against the worker, and ``rl.ban_after`` such batches ban it. The admitted keys are
  journaled (``trainer/admitted.jsonl``, fsynced after the inbox copy, before queueing) so a SIGKILLed
  trainer remembers them; keys of versions older than ``async_level`` are dropped as the trainer moves on.
- **Bounded asynchrony.** The trainer at policy version v trains only on rollouts generated with a
  version >= v - ``run.async_level`` (INTELLECT-2: 2); older ones are refused (counted as stale). It
  takes whichever accepted batches are queued, from any workers, as soon as ``rl.groups_per_step``
  groups are there: it never waits for a particular worker.
- **A step.** Online filter (drop groups whose rewards are all equal), the GRPO step of
  ``trainer/step.py`` in a worker thread, then: checkpoint v+1 atomically with the set of batch IDs now
  consumed (``trainer/checkpoint.py``) -> append a line to ``trainer/metrics.jsonl``; meanwhile v+1 is
  published as delta/full blobs and a signed announcement (``roles/policy.py``) beside the next
  optimizer step (one publication at a time, in order: 1.23 -> 0.96 s a demo step).
- **Crash safety.** After SIGKILL the trainer reloads the latest checkpoint (same version numbering),
  re-queues every inbox batch not in its consumed set (none lost, none trained twice) and re-announces the
  newest published policy (publishing it first if the crash came between checkpoint and publication).

Shortcuts: one optimizer step per batch of groups (no PPO epochs); the trainer does not verify proofs
itself, it relies on the validators it was configured to trust.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from intellect_node.errors import ConfigError, IntellectNodeError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes, atomic_write_text
from intellect_node.roles.policy import PolicyPublisher
from intellect_node.roles.admission import AdmittedJournal, describe_key, rollout_keys
from intellect_node.roles.common import HintedFetcher, blob_service, group_slices, model_dir, record_to_sample, \
    rescore, run_task
from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement, seal_announcement
from intellect_node.protocol.rl import VERDICT_KIND, BatchVerdict, verdict_validator
from intellect_node.protocol.rollout import MAX_BATCH_SIZE, RolloutBatch, decode_batch
from intellect_node.protocol.topics import topic
from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from intellect_node.trainer.filtering import informative_groups
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, StepStats, make_optimizer, train_step

log = logging.getLogger(__name__)

REANNOUNCE_S = 2.0
"""Seconds between repeats of the newest announcement (gossip is not stored: late joiners need it)."""
FETCH_TIMEOUT_S = 60.0
METRICS_FILE = "metrics.jsonl"
ADMITTED_FILE = "admitted.jsonl"


class DuplicateRollouts(ProtocolError):
    """An accepted batch holds rollouts the trainer already admitted."""


def _vote_key(worker: str, cid: str) -> str:
    """Votes and decisions are per (worker, batch): a verdict on a notice that named another worker's
    blob must not decide that worker's batch."""
    return f"{worker}/{cid}"


class VerdictTally:
    """Votes of the trusted validators on each batch: ``quorum`` distinct acceptances admit it and a
    rejection that comes first refuses it. The caller decides each batch once and calls :meth:`done`
    after a successful admission (until then the votes stay, so a failed admission is retried on the next
    acceptance). Bounded: beyond ``limit`` batches the oldest counts are forgotten."""

    def __init__(self, quorum: int, limit: int = 4096) -> None:
        self.quorum = quorum
        self.limit = limit
        self._votes: dict[str, set[str]] = {}

    def vote(self, cid: str, validator: str, accepted: bool) -> str:
        """"admit" (the quorum-th distinct acceptance), "refuse" (a rejection) or "wait"."""
        if not accepted:
            self._votes.pop(cid, None)
            return "refuse"
        votes = self._votes.setdefault(cid, set())
        votes.add(validator)
        while len(self._votes) > self.limit:
            del self._votes[next(iter(self._votes))]
        return "admit" if len(votes) >= self.quorum else "wait"

    def done(self, cid: str) -> None:
        self._votes.pop(cid, None)

    def __len__(self) -> int:
        """Batches with some acceptances but not yet a decision."""
        return len(self._votes)


@dataclass
class Accepted:
    """An accepted batch waiting to be trained on (its samples carry recomputed rewards)."""

    cid: str
    worker: str
    version: int
    groups: list[list[Sample]]
    seq: int


class Trainer:
    name = "trainer"

    def __init__(self, runtime: Any) -> None:
        cfg = runtime.config
        self.rt = runtime
        self.cfg = cfg
        self.rl = cfg.rl
        self.run_id = cfg.run.run_id
        if cfg.run.trainer_peer_id and cfg.run.trainer_peer_id != runtime.swarm.peer_id:
            raise ConfigError(f"run.trainer_peer_id is {cfg.run.trainer_peer_id} but this node is "
                              f"{runtime.swarm.peer_id}; run the trainer with the key the run names",
                              field="run.trainer_peer_id")
        if not cfg.run.validator_peer_ids:
            raise ConfigError("the trainer trains only on work its validators accepted: set "
                              "run.validator_peer_ids (--validator-peer-id)", field="run.validator_peer_ids")
        self.task = run_task(cfg)
        self.dir = Path(runtime.data_dir) / "trainer"
        self.inbox = self.dir / "inbox"
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.gcfg = GRPOConfig(group_size=self.rl.group_size, max_grad_norm=self.rl.max_grad_norm,
                               kl_coef=self.rl.kl_coef,
                               token_budget=self.rl.groups_per_step * self.rl.group_size * self.rl.max_new_tokens)
        self.tally = VerdictTally(cfg.run.verdict_quorum)
        self.allowed = frozenset(cfg.run.worker_allowlist)
        self.queue: deque[Accepted] = deque()
        self.known: set[str] = set()  # _vote_key of batches decided (queued, consumed or refused)
        self.duplicates: dict[str, int] = {}  # worker -> duplicate batches caught here
        self.admitted = AdmittedJournal(self.dir / ADMITTED_FILE)  # rollout keys admitted, per version
        self.consumed: set[str] = set()
        self.pending_consumed: set[str] = set()  # taken but not yet in a checkpoint (all-uniform groups)
        self.version = 0
        self.step = 0
        self._seq = 0
        self._data = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._announcement: bytes | None = None
        self.counts = {"accepted_batches": 0, "rejected_batches": 0, "stale_batches": 0,
                       "accepted_rollouts": 0, "rejected_rollouts": 0, "stale_rollouts": 0, "banned": 0,
                       "duplicate_batches": 0, "not_allowed_batches": 0}
        self.idle_s = 0.0
        self.busy_s = 0.0
        self.last: dict[str, Any] = {}
        self._timing: dict[str, float] = {}
        self._publishing: asyncio.Task[None] | None = None
        self._last_publish_s = 0.0

    @classmethod
    def for_runtime(cls, runtime: Any) -> "Trainer":
        return cls(runtime)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        from intellect_node.models.loader import CharTokenizer, load_hf_model

        torch.set_num_threads(1)
        self.blobs = blob_service(self.rt)
        self.fetcher = HintedFetcher(self.blobs, self.rt.swarm)
        self.tokenizer = CharTokenizer(model_dir(self.cfg) / "tokenizer.json")
        self.model = await asyncio.to_thread(load_hf_model, self.cfg.run.model or None, "float32")
        self.opt = make_optimizer(self.model, self.rl.lr)
        state = await asyncio.to_thread(load_checkpoint, self.dir / "checkpoints", self.model, self.opt)
        if state is None:
            await asyncio.to_thread(save_checkpoint, self.dir / "checkpoints", self.model, self.opt,
                                    TrainerState(version=0))
        else:
            self.version, self.step, self.consumed = state.version, state.step, set(state.consumed)
            log.info("resumed at policy v%d (step %d, %d batches consumed)", self.version, self.step,
                     len(self.consumed))
        self._reload_inbox()
        await self.admitted.compact(self.version - self.cfg.run.async_level)
        self.publisher = PolicyPublisher(self.dir / "policy", self.blobs, self.rt.swarm.key, self.run_id,
                                         full_every=self.rl.full_every)
        await self._publish_current()
        self.rt.board.set_policy(current=self.version, local=self.version)
        trusted = frozenset(self.cfg.run.validator_peer_ids)
        self.rt.swarm.subscribe(topic(self.run_id, VERDICT_KIND), verdict_validator(self.run_id, trusted),
                                self._on_verdict)
        self._tasks = [self.rt.spawn("trainer-loop", self._train_loop, may_end=True),  # ends at max_steps
                       self.rt.spawn("trainer-announce", self._announce_loop)]

    async def close(self) -> None:
        tasks = self._tasks + ([self._publishing] if self._publishing is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if hasattr(self, "fetcher"):
            self.fetcher.close()

    def status(self) -> dict[str, Any]:
        total = self.idle_s + self.busy_s
        return {"version": self.version, "step": self.step, "queued_batches": len(self.queue),
                "awaiting_quorum": len(self.tally), "admitted_keys": len(self.admitted),
                "queued_groups": sum(len(a.groups) for a in self.queue), **self.counts,
                "idle_fraction": self.idle_s / total if total else None, "last_step": self.last}

    # -- policy publication ----------------------------------------------------------------------

    async def _publish_current(self, version: int | None = None,
                               state: dict[str, torch.Tensor] | None = None) -> None:
        """Make sure ``version`` (default: the current one) is published and its announcement is at hand.
        ``state``: that version's weights when the caller copied them (the model may have moved on since)."""
        held = self.publisher.version
        version = self.version if version is None else version
        if held is None or held < version:
            if state is None:
                state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            _, raw = await self.publisher.publish(version, state)
            await asyncio.to_thread(atomic_write_bytes, self.dir / "announcement.bin", raw)
            self._announcement = raw
        else:
            path = self.dir / "announcement.bin"
            raw = path.read_bytes() if path.exists() else b""
            try:
                from intellect_node.protocol.policy import open_announcement

                ok = open_announcement(raw, run_id=self.run_id, trainer=self.rt.swarm.peer_id).version == held
            except ProtocolError:
                ok = False
            if not ok:  # killed between the publisher's commit and ours: rebuild it from its state
                raw = self._rebuild_announcement()
                await asyncio.to_thread(atomic_write_bytes, path, raw)
            self._announcement = raw
        await self.rt.swarm.publish(topic(self.run_id, POLICY_KIND), self._announcement)

    def _rebuild_announcement(self) -> bytes:
        from intellect_node.protocol.policy import DeltaLink
        from intellect_node.trainer.policy_weights import PolicyWeights

        st = json.loads((self.publisher.root / "publisher.json").read_text())
        ckpt = PolicyWeights.load(self.publisher.root / f"v{int(st['version']):010d}.safetensors", max_size=1 << 40)
        by: dict[str, int] = {}
        for info in ckpt.tensors.values():
            by[info.dtype] = by.get(info.dtype, 0) + info.nbytes
        ann = PolicyAnnouncement(run_id=self.run_id, version=int(st["version"]), dtype=max(by, key=lambda k: by[k]),
                                 checkpoint_hash=ckpt.content_hash, checkpoint_size=ckpt.nbytes,
                                 full_version=int(st["full"][0]), full_cid=str(st["full"][1]),
                                 full_size=int(st["full"][2]), deltas=[DeltaLink(**d) for d in st["links"]])
        return seal_announcement(self.rt.swarm.key, ann)

    async def _announce_loop(self) -> None:
        provided: tuple[int, int] = (-1, -1)  # (version, connected peers) when the blobs were last provided
        while True:
            await asyncio.sleep(REANNOUNCE_S)
            raw = self._announcement
            if raw is None:
                continue
            await self.rt.swarm.publish(topic(self.run_id, POLICY_KIND), raw)
            # A DHT provider record made while no peer was connected reaches nobody: provide the policy's
            # blobs again whenever the set of peers grew since (cheap: a handful of records).
            peers = len(self.rt.swarm.connected_peers())
            if (self.version, peers) != provided and peers > provided[1]:
                from intellect_node.protocol.policy import open_announcement

                ann = open_announcement(raw, run_id=self.run_id, trainer=self.rt.swarm.peer_id)
                for cid in [ann.full_cid, *(link.delta_cid for link in ann.deltas)]:
                    try:
                        await self.rt.swarm.provide(cid)
                    except IntellectNodeError as exc:
                        log.info("re-providing %s failed: %s", cid, exc)
                provided = (self.version, peers)
            elif peers < provided[1]:
                provided = (provided[0], peers)

    # -- accepted work ---------------------------------------------------------------------------

    async def _on_verdict(self, msg: tuple[BatchVerdict, str], origin: str) -> None:
        verdict, validator = msg
        if verdict.ban and not self.rt.swarm.is_banned(verdict.worker):
            await self.rt.swarm.ban(verdict.worker, f"banned by validator {validator}: {verdict.reason}")
            self.counts["banned"] += 1
        key = _vote_key(verdict.worker, verdict.batch_cid)
        if key in self.known or verdict.batch_cid in self.consumed:
            return
        if self.allowed and verdict.worker not in self.allowed:
            self.known.add(key)
            self.counts["not_allowed_batches"] += 1
            self.rt.swarm.peerbook.record_rejection(verdict.worker, f"batch {verdict.batch_cid}: not_allowed "
                                                                    f"(not on run.worker_allowlist)")
            return
        if self.tally.vote(key, validator, verdict.accepted) == "wait":
            return  # fewer than run.verdict_quorum validators have accepted it so far
        if not verdict.accepted:
            self.known.add(key)
            self.counts["rejected_batches"] += 1
            self.counts["rejected_rollouts"] += verdict.n_accepted + verdict.n_rejected
            self.rt.board.verdict(False, verdict.n_accepted + verdict.n_rejected, reason=verdict.reason,
                                  detail=verdict.detail, peer=verdict.worker)
            return
        if self.rt.swarm.is_banned(verdict.worker):
            return
        if verdict.policy_version < self.version - self.cfg.run.async_level:
            self.known.add(key)
            self.tally.done(key)
            self._count_stale(verdict.n_accepted)
            return
        self.known.add(key)
        try:
            acc = await self._admit(verdict, validator)
        except asyncio.CancelledError:
            raise
        except DuplicateRollouts as exc:
            self.tally.done(key)
            await self._refuse_duplicate(verdict, str(exc))
            return
        except IntellectNodeError as exc:
            self.known.discard(key)  # another validator's verdict may bring it again
            log.warning("accepted batch %s could not be admitted: %s", verdict.batch_cid, exc)
            return
        self.tally.done(key)
        self.counts["accepted_batches"] += 1
        self.counts["accepted_rollouts"] += verdict.n_accepted
        self.rt.board.verdict(True, verdict.n_accepted, peer=verdict.worker)
        self.queue.append(acc)
        self._data.set()

    async def _refuse_duplicate(self, verdict: BatchVerdict, detail: str) -> None:
        """A batch its validators accepted holds rollouts admitted before: the worker's doing (only it can
        sign a notice for its records), so it counts against it; ``rl.ban_after`` of them ban it."""
        w = verdict.worker
        n = self.duplicates[w] = self.duplicates.get(w, 0) + 1
        self.counts["duplicate_batches"] += 1
        self.counts["rejected_rollouts"] += verdict.n_accepted
        self.rt.swarm.peerbook.record_rejection(w, f"batch {verdict.batch_cid}: duplicate: {detail}")
        self.rt.board.verdict(False, verdict.n_accepted, reason="duplicate", detail=detail, peer=w)
        log.warning("batch %s from %s refused: duplicate (%s)", verdict.batch_cid, w, detail)
        if n >= self.rl.ban_after and not self.rt.swarm.is_banned(w):
            await self.rt.swarm.ban(w, f"{n} duplicate batches")
            self.counts["banned"] += 1

    def _count_stale(self, n: int) -> None:
        self.counts["stale_batches"] += 1
        self.counts["stale_rollouts"] += n

    async def _admit(self, verdict: BatchVerdict, validator: str) -> Accepted:
        cid = verdict.batch_cid
        data = await self.fetcher.fetch(cid, holders=[verdict.worker, validator], max_size=MAX_BATCH_SIZE,
                                        timeout=FETCH_TIMEOUT_S)
        batch = await asyncio.to_thread(decode_batch, data)
        version = verdict.policy_version
        groups = self._groups(batch, verdict.worker, version)
        keys = rollout_keys(batch.rollouts)
        # Check and reserve with no await between: two verdicts cannot both pass with the same rollouts.
        dup = self.admitted.first_seen(version, keys)
        if dup is not None:
            raise DuplicateRollouts(f"{describe_key(dup)} at v{version} was admitted before")
        self.admitted.add(version, keys)
        try:
            self._seq += 1
            # Persist before queueing: a crash from here on re-queues it from the inbox (and its keys
            # with it, should the journal line below not have made it).
            await asyncio.to_thread(atomic_write_bytes, self.inbox / f"{cid}.batch", data)
            meta = {"cid": cid, "worker": verdict.worker, "version": version, "seq": self._seq,
                    "time": time.time()}
            await asyncio.to_thread(atomic_write_text, self.inbox / f"{cid}.json", json.dumps(meta))
            await self.admitted.append(version, verdict.worker, cid, keys)
        except BaseException:
            self.admitted.discard(version, keys)
            raise
        return Accepted(cid, verdict.worker, version, groups, self._seq)

    def _groups(self, batch: RolloutBatch, worker: str, version: int) -> list[list[Sample]]:
        recs = batch.rollouts
        if batch.run_id != self.run_id or batch.policy_version != version or any(r.worker != worker for r in recs):
            raise ProtocolError("batch does not match its verdict")
        slices = group_slices(recs, self.rl.group_size)
        if isinstance(slices, str):
            raise ProtocolError(slices)
        out = []
        for sl in slices:
            problem = self.task.get(recs[sl.start].problem_id)
            out.append([record_to_sample(r, rescore(r, problem, self.tokenizer.decode)) for r in recs[sl]])
        return out

    def _reload_inbox(self) -> None:
        """After a restart: queue every persisted batch not in the checkpoint's consumed set."""
        found = []
        for meta_path in self.inbox.glob("*.json"):
            try:
                meta = json.loads(meta_path.read_text())
                cid = str(meta["cid"])
                if cid in self.consumed:
                    self._drop_inbox(cid)
                    continue
                batch = decode_batch((self.inbox / f"{cid}.batch").read_bytes())
                worker, version = str(meta["worker"]), int(meta["version"])
                groups = self._groups(batch, worker, version)
            except (OSError, ValueError, KeyError, IntellectNodeError) as exc:
                log.warning("inbox entry %s unreadable (%s); skipped", meta_path.name, exc)
                continue
            keys = rollout_keys(batch.rollouts)
            if not self.admitted.holds(version, keys):  # killed between the inbox write and the journal
                self.admitted.append_now(version, worker, cid, keys)
            found.append(Accepted(cid, worker, version, groups, int(meta["seq"])))
        for acc in sorted(found, key=lambda a: a.seq):
            self.queue.append(acc)
            self.known.add(_vote_key(acc.worker, acc.cid))
            self._seq = max(self._seq, acc.seq)
        if found:
            log.info("re-queued %d accepted batches from the inbox", len(found))
            self._data.set()

    def _drop_inbox(self, cid: str) -> None:
        for suffix in (".json", ".batch"):
            (self.inbox / f"{cid}{suffix}").unlink(missing_ok=True)

    # -- training --------------------------------------------------------------------------------

    def _take(self) -> tuple[list[Accepted], list[Accepted]] | None:
        """Whole batches holding at least ``groups_per_step`` fresh groups, newest policy first; stale
        ones split off.

        Newest first because workers run ahead of the trainer (``batches_per_version`` > 1): taking the
        oldest would train on rollouts ``async_level`` versions old every step, while the newest are at most
        a version behind. Older fresh batches stay queued and are used if nothing newer comes in time.
        """
        floor = self.version - self.cfg.run.async_level
        fresh = [a for a in self.queue if a.version >= floor]
        if sum(len(a.groups) for a in fresh) < self.rl.groups_per_step:
            return None
        stale = [a for a in self.queue if a.version < floor]
        taken: list[Accepted] = []
        n = 0
        for a in sorted(fresh, key=lambda a: (-a.version, a.seq)):
            if n >= self.rl.groups_per_step:
                break
            taken.append(a)
            n += len(a.groups)
        gone = {a.cid for a in taken} | {a.cid for a in stale}
        self.queue = deque(a for a in self.queue if a.cid not in gone)
        return taken, stale

    async def _train_loop(self) -> None:
        t_mark = time.monotonic()
        while self.rl.max_steps is None or self.step < self.rl.max_steps:
            got = self._take()
            if got is None:
                self._data.clear()
                try:
                    await asyncio.wait_for(self._data.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                now = time.monotonic()
                self.idle_s += now - t_mark
                t_mark = now
                continue
            taken, stale = got
            for a in stale:
                self._count_stale(sum(len(g) for g in a.groups))
            await self._step(taken, [a.cid for a in stale])
            now = time.monotonic()
            self.busy_s += now - t_mark
            t_mark = now
        if self._publishing is not None:  # max_steps reached: the last version goes out before we idle
            await self._publishing

    async def _step(self, taken: list[Accepted], refused: list[str]) -> None:
        groups = [g for a in taken for g in a.groups]
        samples_all = [s for g in groups for s in g]
        useful = informative_groups(groups, lambda s: s.reward)
        ids = {a.cid for a in taken} | set(refused)
        if not useful:
            # No gradient signal: nothing to train; these IDs go into the next checkpoint's consumed set
            # (re-processing them after a crash would find them uniform again).
            self.pending_consumed |= ids
            self._record(None, samples_all, len(groups), 0, sorted(ids))
            return
        samples = [s for g in useful for s in g]
        t0 = time.monotonic()
        stats = await asyncio.to_thread(train_step, self.model, self.opt, samples, self.gcfg,
                                        temperature=self.rl.temperature)
        t1 = time.monotonic()
        self.version += 1
        self.step += 1
        ids |= self.pending_consumed
        self.consumed |= ids
        self.pending_consumed = set()
        await asyncio.to_thread(save_checkpoint, self.dir / "checkpoints", self.model, self.opt,
                                TrainerState(version=self.version, consumed=frozenset(self.consumed),
                                             step=self.step))
        t2 = time.monotonic()
        for cid in ids:  # committed in the checkpoint: the inbox copies are no longer needed
            self._drop_inbox(cid)
        # Rollouts older than async_level are refused as stale from now on: their keys can go.
        await self.admitted.compact(self.version - self.cfg.run.async_level)
        # Publication overlaps the next optimizer step: the weights are copied now (the next step moves
        # them), one publication runs at a time, in version order. A crash before it finishes is covered
        # by the restart path (_publish_current publishes the checkpointed version first).
        if self._publishing is not None:
            await self._publishing
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._publishing = asyncio.create_task(self._publish_in_background(self.version, state, t2),
                                               name="trainer-publish")
        # Where a step's time goes (seconds): the optimizer step, the checkpoint; publish_s is the last
        # finished publication's (it runs beside the next step).
        self._timing = {"train_s": t1 - t0, "checkpoint_s": t2 - t1, "publish_s": self._last_publish_s}
        self._record(stats, samples_all, len(groups), len(useful), sorted(ids))

    async def _publish_in_background(self, version: int, state: dict[str, torch.Tensor], t0: float) -> None:
        try:
            await self._publish_current(version, state)
        except asyncio.CancelledError:
            raise
        except Exception:  # keep training: the next step (or a restart) publishes again
            log.exception("publishing policy v%d failed", version)
            return
        self._last_publish_s = time.monotonic() - t0
        self.rt.board.set_policy(current=version, local=version)

    def _record(self, stats: StepStats | None, samples: list[Sample], n_groups: int, n_useful: int,
                batches: list[str]) -> None:
        rewards = [s.reward for s in samples]
        pass_rate = sum(1 for r in rewards if r >= 1.0) / max(len(rewards), 1)
        reward_mean = sum(rewards) / max(len(rewards), 1)
        # Staleness: how many versions behind the weights being updated each sample's policy was.
        base = self.version - (1 if stats is not None else 0)
        stale = [base - s.policy_version for s in samples]
        total = self.idle_s + self.busy_s
        line = {"step": self.step, "version": self.version, "trained": stats is not None, "time": time.time(),
                "pass_rate": pass_rate, "reward_mean": reward_mean, "samples": len(samples),
                "groups": n_groups, "groups_used": n_useful,
                "loss": stats.loss if stats else 0.0, "grad_norm": stats.grad_norm if stats else 0.0,
                "clipped_frac": stats.clipped_frac if stats else 0.0,
                "staleness_mean": sum(stale) / max(len(stale), 1), "staleness_max": max(stale, default=0),
                "accepted": self.counts["accepted_rollouts"], "rejected": self.counts["rejected_rollouts"],
                "stale": self.counts["stale_rollouts"], "idle_fraction": self.idle_s / total if total else 0.0,
                "batches": batches, **(self._timing if stats is not None else {})}
        self.last = line
        path = self.dir / METRICS_FILE
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if stats is not None:
            self.rt.board.train_step(self.step, reward_mean=reward_mean, pass_rate=pass_rate)
        log.info("step %d -> v%d: pass %.3f reward %.3f (%d samples, %d/%d groups, staleness %.2f)",
                 self.step, self.version, pass_rate, reward_mean, len(samples), n_useful, n_groups,
                 line["staleness_mean"])
