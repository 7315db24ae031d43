"""Trainer role: GRPO on accepted rollouts, bounded staleness, atomic policy publication, resume.

- **Inputs.** The trainer listens to verdicts from the run's validators (``run.validator_peer_ids``);
  which verdicts take a batch in, and which queued batches form a step, the pure state machine of
  ``roles/batching.py`` decides. ``run.verdict_quorum`` of them must accept a batch (default 1; a
  rejection that comes first refuses it, so one faulty validator can delay work but not get bad work
  trained on). Votes are counted per (worker, batch), so a peer naming someone else's batch in its own
  notice cannot get it refused.
  Admission fetches the batch blob, decodes it strictly, checks it is the named worker's and in whole
  groups, recomputes every reward from the task (claimed rewards are never used), and *persists* it to
  ``trainer/inbox`` before queueing it (``roles/inbox.py``). A verdict carrying ``ban`` bans the worker
  here too, so its later notices and verdict replays are dropped at the gossip validator. In a closed run
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
from pathlib import Path
from typing import Any

import torch

from intellect_node.errors import ConfigError, IntellectNodeError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement
from intellect_node.protocol.rl import VERDICT_KIND, BatchVerdict, verdict_validator
from intellect_node.protocol.rollout import MAX_BATCH_SIZE, RolloutBatch, decode_batch
from intellect_node.protocol.topics import topic
from intellect_node.roles.admission import rollout_keys
from intellect_node.roles.batching import Accepted, Admission, fresh_floor
from intellect_node.roles.common import (
    HintedFetcher,
    blob_service,
    group_slices,
    model_dir,
    record_to_sample,
    rescore,
    run_task,
)
from intellect_node.roles.inbox import DuplicateRollouts, Inbox
from intellect_node.roles.policy import PolicyPublisher
from intellect_node.roles.seams import RoleTasks, Runtime
from intellect_node.trainer.checkpoint import TrainerState, committed_policy, load_checkpoint, save_checkpoint
from intellect_node.trainer.filtering import informative_groups
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.policy_weights import PolicyWeights
from intellect_node.trainer.step import Sample, StepStats, make_optimizer, train_step

log = logging.getLogger(__name__)

REANNOUNCE_S = 2.0
"""Seconds between repeats of the newest announcement (gossip is not stored: late joiners need it)."""
FETCH_TIMEOUT_S = 60.0
METRICS_FILE = "metrics.jsonl"
ADMITTED_FILE = "admitted.jsonl"


class Trainer:
    name = "trainer"

    def __init__(self, runtime: Runtime) -> None:
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
        self.inbox = Inbox(self.dir / "inbox", self.dir / ADMITTED_FILE)  # admitted work, across crashes
        self.admitted = self.inbox.admitted  # rollout keys admitted, per version
        budget = self.rl.groups_per_step * self.rl.group_size * self.rl.max_new_tokens
        self.gcfg = GRPOConfig(group_size=self.rl.group_size, max_grad_norm=self.rl.max_grad_norm,
                               kl_coef=self.rl.kl_coef, token_budget=budget)
        self.admission = Admission(quorum=cfg.run.verdict_quorum, async_level=cfg.run.async_level,
                                   groups_per_step=self.rl.groups_per_step,
                                   allowed=frozenset(cfg.run.worker_allowlist))
        self.duplicates: dict[str, int] = {}  # worker -> duplicate batches caught here
        self.consumed: set[str] = set()
        self.pending_consumed: set[str] = set()  # taken but not yet in a checkpoint (all-uniform groups)
        self.version = 0
        self.step = 0
        self._data = asyncio.Event()
        self.tasks = RoleTasks(runtime, "trainer")  # the train and announce loops; publications
        self._announcement: tuple[PolicyAnnouncement, bytes] | None = None  # the newest version's
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
    def for_runtime(cls, runtime: Runtime) -> "Trainer":
        return cls(runtime)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        from intellect_node.models.loader import ModelTokenizer
        from intellect_node.trainer.model import TrainOptions, load_trainable

        torch.set_num_threads(1)
        self.blobs = blob_service(self.rt)
        self.fetcher = HintedFetcher(self.blobs, self.rt.swarm)
        self.tokenizer = ModelTokenizer(model_dir(self.cfg))
        self.train_options = TrainOptions.from_section(self.rl)  # fp32 on the CPU unless the config says
        self.model = await asyncio.to_thread(load_trainable, model_dir(self.cfg), self.train_options)
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
        await self.admitted.compact(fresh_floor(self.version, self.cfg.run.async_level))
        self.publisher = PolicyPublisher(self.dir / "policy", self.blobs, self.rt.swarm.key, self.run_id,
                                         full_every=self.rl.full_every)
        await self._publish_current()
        self.rt.board.set_policy(current=self.version, local=self.version)
        trusted = frozenset(self.cfg.run.validator_peer_ids)
        self.rt.swarm.subscribe(topic(self.run_id, VERDICT_KIND), verdict_validator(self.run_id, trusted),
                                self._on_verdict)
        await self.tasks.open()
        self.tasks.loop("trainer-loop", self._train_loop, may_end=True)  # ends at max_steps
        self.tasks.loop("trainer-announce", self._announce_loop)

    async def close(self) -> None:
        await self.tasks.close()
        if hasattr(self, "fetcher"):
            self.fetcher.close()

    def status(self) -> dict[str, Any]:
        total = self.idle_s + self.busy_s
        return {"version": self.version, "step": self.step, "queued_batches": len(self.admission.queue),
                "awaiting_quorum": len(self.admission.tally), "admitted_keys": len(self.admitted),
                "queued_groups": self.admission.queued_groups(), **self.counts,
                "idle_fraction": self.idle_s / total if total else None, "last_step": self.last}

    # -- policy publication ----------------------------------------------------------------------

    async def _publish_current(self, version: int | None = None,
                               state: PolicyWeights | None = None) -> None:
        """Make sure ``version`` (default: the current one) is published, and announce it.
        ``state``: that version's committed weights (the model may have moved on since)."""
        version = self.version if version is None else version
        held = self.publisher.version
        # Published before a restart: the publisher signs its announcement again (the same bytes).
        got = self.publisher.announcement() if held is not None and held >= version else None
        if got is None:
            if state is None:  # the checkpoint of the current version, mapped: no copy of the model
                state = await asyncio.to_thread(committed_policy, self.dir / "checkpoints")
            got = await self.publisher.publish(version, state)
        self._announcement = got
        raw = got[1]
        await asyncio.to_thread(atomic_write_bytes, self.dir / "announcement.bin", raw)
        await self.rt.swarm.publish(topic(self.run_id, POLICY_KIND), raw)

    async def _announce_loop(self) -> None:
        provided: tuple[int, int] = (-1, -1)  # (version, connected peers) when the blobs were last provided
        while True:
            await asyncio.sleep(REANNOUNCE_S)
            if self._announcement is None:
                continue
            ann, raw = self._announcement
            await self.rt.swarm.publish(topic(self.run_id, POLICY_KIND), raw)
            # A DHT provider record made while no peer was connected reaches nobody: provide the policy's
            # blobs again whenever the set of peers grew since (cheap: a handful of records).
            peers = len(self.rt.swarm.connected_peers())
            if (self.version, peers) != provided and peers > provided[1]:
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
        w, cid = verdict.worker, verdict.batch_cid
        decision = self.admission.decide(verdict, validator, version=self.version,
                                         consumed=cid in self.consumed, banned=self.rt.swarm.is_banned(w))
        if decision == "not_allowed":
            self.counts["not_allowed_batches"] += 1
            self.rt.swarm.peerbook.record_rejection(w, f"batch {cid}: not_allowed "
                                                       "(not on run.worker_allowlist)")
        elif decision == "refuse":
            self.counts["rejected_batches"] += 1
            self.counts["rejected_rollouts"] += verdict.n_accepted + verdict.n_rejected
            self.rt.board.verdict(False, verdict.n_accepted + verdict.n_rejected, reason=verdict.reason,
                                  detail=verdict.detail, peer=w)
        elif decision == "stale":
            self._count_stale(verdict.n_accepted)
        elif decision == "admit":
            await self._take_in(verdict, validator)

    async def _take_in(self, verdict: BatchVerdict, validator: str) -> None:
        """Fetch, check and persist a batch its validators accepted, then queue it."""
        w, cid = verdict.worker, verdict.batch_cid
        try:
            acc = await self._admit(verdict, validator)
        except asyncio.CancelledError:
            raise
        except DuplicateRollouts as exc:
            self.admission.refused(w, cid)
            await self._refuse_duplicate(verdict, str(exc))
            return
        except IntellectNodeError as exc:
            self.admission.failed(w, cid)  # another validator's verdict may bring it again
            log.warning("accepted batch %s could not be admitted: %s", cid, exc)
            return
        self.counts["accepted_batches"] += 1
        self.counts["accepted_rollouts"] += verdict.n_accepted
        self.rt.board.verdict(True, verdict.n_accepted, peer=w)
        self.admission.add(acc)
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
        w, cid, version = verdict.worker, verdict.batch_cid, verdict.policy_version
        data = await self.fetcher.fetch(cid, holders=[w, validator], max_size=MAX_BATCH_SIZE,
                                        timeout=FETCH_TIMEOUT_S)
        batch = await asyncio.to_thread(decode_batch, data)
        # re-scoring runs checkers (math-verify: ~12 ms a rollout, up to rl.reward_timeout_s on hostile
        # text): off the event loop
        groups = await asyncio.to_thread(self._groups, batch, w, version)
        seq = await self.inbox.admit(cid, w, version, data, rollout_keys(batch.rollouts))
        return Accepted(cid, w, version, groups, seq)

    def _groups(self, batch: RolloutBatch, worker: str, version: int) -> list[list[Sample]]:
        recs = batch.rollouts
        if batch.run_id != self.run_id or batch.policy_version != version \
                or any(r.worker != worker for r in recs):
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
        found = self.inbox.reload(self.consumed, self._groups)
        for acc in found:
            self.admission.add(acc)
        if found:
            log.info("re-queued %d accepted batches from the inbox", len(found))
            self._data.set()

    # -- training --------------------------------------------------------------------------------

    async def _train_loop(self) -> None:
        t_mark = time.monotonic()
        while self.rl.max_steps is None or self.step < self.rl.max_steps:
            got = self.admission.take(self.version)
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
            for a in got.stale:
                self._count_stale(sum(len(g) for g in a.groups))
            await self._step(got.taken, [a.cid for a in got.stale])
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
                                        temperature=self.rl.temperature,
                                        micro_tokens=self.train_options.micro_batch_tokens,
                                        compute_dtype=self.train_options.compute_dtype)
        t1 = time.monotonic()
        self.version += 1
        self.step += 1
        ids |= self.pending_consumed
        self.consumed |= ids
        self.pending_consumed = set()
        saved = TrainerState(version=self.version, consumed=frozenset(self.consumed), step=self.step)
        committed = await asyncio.to_thread(save_checkpoint, self.dir / "checkpoints", self.model, self.opt,
                                            saved)
        t2 = time.monotonic()
        for cid in ids:  # committed in the checkpoint: the inbox copies are no longer needed
            self.inbox.drop(cid)
        # Rollouts older than async_level are refused as stale from now on: their keys can go.
        await self.admitted.compact(fresh_floor(self.version, self.cfg.run.async_level))
        # Publication overlaps the next optimizer step: it reads the checkpoint just committed (mapped
        # from disk, so a multi-GB model is not copied in memory while the next step moves the weights),
        # one publication runs at a time, in version order. A crash before it finishes is covered
        # by the restart path (_publish_current publishes the checkpointed version first).
        if self._publishing is not None:
            await self._publishing
        state = await asyncio.to_thread(committed_policy, self.dir / "checkpoints", committed)
        self._publishing = self.tasks.job(self._publish_in_background(self.version, state, t2),
                                          f"publishing policy v{self.version}")
        # Where a step's time goes (seconds): the optimizer step, the checkpoint; publish_s is the last
        # finished publication's (it runs beside the next step).
        self._timing = {"train_s": t1 - t0, "checkpoint_s": t2 - t1, "publish_s": self._last_publish_s}
        self._record(stats, samples_all, len(groups), len(useful), sorted(ids))

    async def _publish_in_background(self, version: int, state: PolicyWeights, t0: float) -> None:
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
                "stale": self.counts["stale_rollouts"],
                "idle_fraction": self.idle_s / total if total else 0.0,
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
