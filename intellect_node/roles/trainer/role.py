"""Trainer role: GRPO on accepted rollouts, bounded staleness, atomic policy publication, resume.

The parts, each in its own module; none of them references the ``Trainer``, which builds them in
``__init__``/``start`` and wires them together in this one place:

- ``admission.py``: ``Admission``, the pure state machine deciding which verdicts take a batch in and
  which queued batches form a step (its tallies and queued batches are in ``batching.py``);
- ``inbox.py``: ``Inbox``, the admitted batches on disk until a checkpoint holds them, and
  ``StepJournal``, the steps taken since that checkpoint (replayed after a crash);
- ``admitted.py``: ``AdmittedJournal``, the rollout keys admitted per version (the inbox holds it);
- ``prefetch.py``: ``Prefetch``, the batches named by workers' notices, fetched while validators verify;
- ``metrics.py``: ``MetricsFile``, ``trainer/metrics.jsonl`` and the last journaled step it recorded;
- from ``roles/common/``: ``PolicyPublisher`` (``policy.py``: delta/full blobs and signed announcements),
  ``HintedFetcher`` (``fetch.py``), the run's task and re-scored samples (``tasks.py``, ``records.py``),
  and ``RoleTasks`` (``seams.py``) for the train and announce loops and the publications.

The Trainer itself holds the gossip handlers (verdicts, notices), the training loop, checkpoints and the
status it reports.

- **Inputs.** The trainer listens to verdicts from the run's validators (``run.validator_peer_ids``);
  which verdicts take a batch in, and which queued batches form a step, the pure state machine of
  ``roles/trainer/admission.py`` decides. ``run.verdict_quorum`` of them must accept a batch (default 1; a
  rejection that comes first refuses it, so one faulty validator can delay work but not get bad work
  trained on). Votes are counted per (worker, batch), so a peer naming someone else's batch in its own
  notice cannot get it refused.
  Admission fetches the batch blob, decodes it strictly, checks it is the named worker's and in whole
  groups, recomputes every reward from the task (claimed rewards are never used), and *persists* it to
  ``trainer/inbox`` before queueing it (``roles/trainer/inbox.py``). Every record's signature is checked (a
  validator cannot plant records under an honest worker's name), every problem must be of the run's
  task (``wrong_task``) and the batch one of its worker's assignment windows (``not_assigned``:
  ``envs/assignment.py``). A verdict is acted on only inside a time window around this node's clock
  (``protocol.rl.verdict_time_error``: an old one replayed is ignored); one whose reason is not the
  worker's fault (the validator lags or lacks the policy) decides nothing. A verdict carrying ``ban`` is
  one validator's vote: ``run.verdict_quorum`` of them, each about a batch the worker itself announced
  (this trainer heard its notice), ban the worker here too; the run's trainer and validators are never
  banned by verdicts. In a closed run (``run.worker_allowlist``) other workers' batches are refused
  (``not_allowed``).
- **Each rollout once.** A batch holding a rollout already admitted (same run, version, worker, problem
  and sample index, or rollout ID; ``roles/common/seen.py``) is refused as ``duplicate`` whatever its blob
  CID, recorded against the worker, and ``rl.ban_after`` such batches ban it. The admitted keys are
  journaled (``trainer/admitted.jsonl``, fsynced after the inbox copy, before queueing) so a SIGKILLed
  trainer remembers them; keys of versions older than ``async_level`` are dropped as the trainer moves on.
- **Bounded asynchrony.** The trainer at policy version v trains only on rollouts generated with a
  version >= v - ``run.async_level`` (INTELLECT-2: 2); older ones are refused (counted as stale). It
  takes whichever accepted batches are queued, from any workers, as soon as ``rl.groups_per_step``
  groups are there: it never waits for a particular worker.
- **A step.** The batches it takes are journaled first (``trainer/steps.jsonl``, fsynced;
  ``roles/trainer/inbox.py``), then the online filter (drop groups whose rewards are all equal) and the GRPO
  step of ``trainer/step.py`` run in a worker thread, which also copies the new weights into canonical policy
  bytes before the next step can move them. Version v+1 is published from that copy as delta/full blobs
  and a signed announcement (``roles/common/policy.py``) beside the next optimizer step (one publication at a
  time, in order). Every ``rl.checkpoint_every`` steps the weights, AdamW state and consumed batch IDs
  are checkpointed atomically (``trainer/checkpoint.py``); then the inbox copies of the batches it holds
  and the journal entries it covers go. A line per step goes to ``trainer/metrics.jsonl``, with the
  timestamps of each batch's hops (notice heard, prefetched, verdict heard, admitted) and of the step's.
- **No signal.** A step attempt whose groups all have equal rewards trains nothing: its batches are
  consumed (journaled, recorded in ``metrics.jsonl`` with ``trained`` false and the cause), no version is
  made, and the workers, capped per version, resubmit after a while. Every attempt is reported to the
  status board (``board.train_attempt``: groups dropped, the cause when all were, a hint naming the
  settings to check); a streak of them raises ``training.no_signal_warning``, logged once as a warning.
  The first completion of each admitted group goes to ``training.completions``
  (``roles/common/completions.py``).
- **Prefetch.** The trainer also hears workers' notices and fetches and decodes the batches they name
  while the validators verify them (``roles/trainer/prefetch.py``), so a verdict only releases a batch.
- **Crash safety.** After SIGKILL the trainer reloads the latest checkpoint (same version numbering),
  re-queues every inbox batch not in its consumed set (none lost, none trained twice) and replays the
  journaled steps since the checkpoint, taking the same batches in the same order: on the CPU this gives
  bit-identical weights, so every version it announced comes out again with the announced hash (checked
  against the publisher's record of the newest). Should the replay fall short or differ (an inbox copy
  lost, another device), the trainer publishes what it has under a version past the newest announced one,
  never different content under an announced version. Then it re-announces (or publishes) the newest.
Shortcuts: one optimizer step per batch of groups (no PPO epochs); the trainer does not verify proofs
itself, it relies on the validators it was configured to trust.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import Any

import torch

from intellect_node.config.status import Completion
from intellect_node.envs.assignment import Coverage
from intellect_node.envs.extract import Extraction
from intellect_node.errors import ConfigError, IntellectNodeError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement
from intellect_node.protocol.rl import (
    NOTICE_KIND,
    VERDICT_KIND,
    BatchVerdict,
    RolloutNotice,
    notice_validator,
    now_ms,
    verdict_time_error,
    verdict_validator,
)
from intellect_node.protocol.rollout import (
    MAX_BATCH_SIZE,
    RolloutBatch,
    decode_batch,
    verify_rollout_signature,
)
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.completions import completion
from intellect_node.roles.common.fetch import ANNOUNCE_MIN_CHUNKS, HintedFetcher
from intellect_node.roles.common.models import model_dir
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.roles.common.records import group_slices, rescored_group
from intellect_node.roles.common.seams import RoleTasks, Runtime
from intellect_node.roles.common.seen import BoundedMap, rollout_keys
from intellect_node.roles.common.services import blob_service
from intellect_node.roles.common.tasks import run_assignments, run_task, wrong_task
from intellect_node.roles.trainer.admission import Admission
from intellect_node.roles.trainer.batching import Accepted, fresh_floor, vote_key
from intellect_node.roles.trainer.inbox import Inbox, JournalEntry, RefusedBatch, StepJournal
from intellect_node.roles.trainer.metrics import MetricsFile
from intellect_node.roles.trainer.prefetch import Prefetch
from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, read_optimizer, save_checkpoint
from intellect_node.trainer.filtering import FilteredGroups, filter_groups
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.optim import Optimizer
from intellect_node.trainer.step import Sample, StepStats, make_optimizer, train_step

log = logging.getLogger(__name__)

REANNOUNCE_S = 2.0
"""Seconds between repeats of the newest announcement (gossip is not stored: late joiners need it)."""
FETCH_TIMEOUT_S = 60.0
ADMITTED_FILE = "admitted.jsonl"
JOURNAL_FILE = "steps.jsonl"
SHOWN_LEN = 32
"""Recent completions (one per admitted group) the no-signal hint counts missing answers over."""
CONSUMED_KEEP_VERSIONS = 64
"""Consumed batch IDs are kept (in memory and in each checkpoint) for this many policy versions: a verdict
on an older batch is refused as stale anyway (``run.async_level`` is at most 16), and the set no longer
grows with the length of the run."""
PEERS_KEPT = 65536
"""Workers whose refusals are counted here, and notices remembered (what a peer can make us hold)."""


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
        self.assignments = run_assignments(cfg, self.task)  # each batch must be one of its worker's windows
        self.coverage = Coverage(PEERS_KEPT)  # the windows each worker's admitted batches filled and skipped
        self.dir = Path(runtime.data_dir) / "trainer"
        self.inbox = Inbox(self.dir / "inbox", self.dir / ADMITTED_FILE)  # admitted work, across crashes
        self.admitted = self.inbox.admitted  # rollout keys admitted, per version
        self.journal = StepJournal(self.dir / JOURNAL_FILE)  # the steps since the last checkpoint
        budget = self.rl.groups_per_step * self.rl.group_size * self.rl.max_new_tokens
        self.gcfg = GRPOConfig(group_size=self.rl.group_size, max_grad_norm=self.rl.max_grad_norm,
                               kl_coef=self.rl.kl_coef, token_budget=budget)
        # Verdicts never ban the run's own trainer and validators (one validator could otherwise ban them).
        protected = frozenset({runtime.swarm.peer_id, *cfg.run.validator_peer_ids})
        self.admission = Admission(quorum=cfg.run.verdict_quorum, async_level=cfg.run.async_level,
                                   groups_per_step=self.rl.groups_per_step,
                                   allowed=frozenset(cfg.run.worker_allowlist), protected=protected)
        self.refusals: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)  # worker -> batches refused here
        self.consumed: dict[str, int] = {}  # batch CID -> policy version (CONSUMED_KEEP_VERSIONS kept)
        self._heard: BoundedMap[str, int] = BoundedMap(PEERS_KEPT)  # vote_key of notices heard -> version
        self._clock_warned: set[str] = set()  # validators whose verdicts came outside the time window
        self._undropped: set[str] = set()  # consumed, inbox copy kept until a checkpoint holds it
        self.version = 0
        self.step = 0
        self._ckpt_version = 0
        self._data = asyncio.Event()
        self.tasks = RoleTasks(runtime, "trainer")  # the train and announce loops; publications
        self._announcement: tuple[PolicyAnnouncement, bytes] | None = None  # the newest version's
        self.counts = {"accepted_batches": 0, "rejected_batches": 0, "stale_batches": 0,
                       "accepted_rollouts": 0, "rejected_rollouts": 0, "stale_rollouts": 0, "banned": 0,
                       "duplicate_batches": 0, "not_allowed_batches": 0, "unjudged_groups": 0,
                       "wrong_task_batches": 0, "bad_signature_batches": 0, "abstained_verdicts": 0,
                       "expired_verdicts": 0, "ban_votes": 0, "not_assigned_batches": 0}
        self.replay: dict[str, Any] = {"steps": 0, "outcome": "none"}
        self.idle_s = 0.0
        self.busy_s = 0.0
        self.last: dict[str, Any] = {}
        self._timing: dict[str, float] = {}
        self._checkpoint_s = 0.0  # the last checkpoint's seconds, reported on the next step's line
        self._publishing: asyncio.Task[None] | None = None
        self._published: dict[str, float] = {}  # the last finished publication: version, time, seconds
        self.hops: BoundedMap[str, dict[str, float]] = BoundedMap(1024)  # batch CID -> hop -> wall time
        # One completion per admitted group, newest last (appended from the admission thread): what the
        # no-signal hint counts missing answers in. The answer format as the task resolves it ("auto").
        self._shown: collections.deque[Completion] = collections.deque(maxlen=SHOWN_LEN)
        self._answer_mode = ""
        self._no_signal_logged = False  # the current streak's warning went to the log

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
        self.prefetch = Prefetch(self._prefetch_one)
        self.tokenizer = ModelTokenizer(model_dir(self.cfg))
        self.train_options = TrainOptions.from_section(self.rl)  # fp32 on the CPU unless the config says
        self.model = await asyncio.to_thread(load_trainable, model_dir(self.cfg), self.train_options)
        ckpt = self.dir / "checkpoints"
        state = await asyncio.to_thread(load_checkpoint, ckpt, self.model)
        self.opt: Optimizer | None = None
        if state is None:
            # Version 0's checkpoint holds the weights alone: an optimizer has no state before its first
            # step. The training loop builds it while the first batches are made, after v0 is out: on a
            # GPU, torch.optim imports torch._dynamo then (about 1 s of one core; trainer/optim.py).
            await asyncio.to_thread(save_checkpoint, ckpt, self.model, None,
                                    TrainerState(version=0, extra={"journal_seq": self.journal.seq}))
            covered = self.journal.seq
        else:
            self.opt = await asyncio.to_thread(self._optimizer, ckpt)
            # The checkpoint does not say each batch's version: they count as the checkpoint's own.
            self.version, self.step = state.version, state.step
            self.consumed = dict.fromkeys(state.consumed, state.version)
            covered = int(state.extra.get("journal_seq", 0))
            log.info("resumed at policy v%d (step %d, %d batches consumed)", self.version, self.step,
                     len(self.consumed))
        self._ckpt_version = self.version
        self.journal.seq = max(self.journal.seq, covered)  # a trimmed journal numbers on from the checkpoint
        self.metrics = MetricsFile(self.dir)  # replayed steps are not recorded twice
        self._reload_inbox()
        await self.admitted.compact(fresh_floor(self.version, self.cfg.run.async_level))
        self.publisher = PolicyPublisher(self.dir / "policy", self.blobs, self.rt.swarm.key, self.run_id,
                                         full_every=self.rl.full_every,
                                         chunk_size=int(self.rl.policy_chunk_mib * (1 << 20)),
                                         announce_min_chunks=ANNOUNCE_MIN_CHUNKS)
        await self.tasks.open()
        newest = await self._replay(self.journal.after(covered))
        await self._publish_current(self.version, newest)
        self.rt.board.set_policy(current=self.version, local=self.version)
        trusted = frozenset(self.cfg.run.validator_peer_ids)
        self.rt.swarm.subscribe(topic(self.run_id, VERDICT_KIND), verdict_validator(self.run_id, trusted),
                                self._on_verdict)
        allowed = frozenset(self.cfg.run.worker_allowlist) or None
        self.rt.swarm.subscribe(topic(self.run_id, NOTICE_KIND), notice_validator(self.run_id, allowed),
                                self._on_notice)
        self.tasks.loop("trainer-loop", self._train_loop, may_end=True)  # ends at max_steps
        self.tasks.loop("trainer-announce", self._announce_loop)

    async def close(self) -> None:
        await self.tasks.close()
        if hasattr(self, "prefetch"):
            self.prefetch.close()
        if hasattr(self, "fetcher"):
            self.fetcher.close()

    def status(self) -> dict[str, Any]:
        total = self.idle_s + self.busy_s
        return {"version": self.version, "step": self.step, "queued_batches": len(self.admission.queue),
                "awaiting_quorum": len(self.admission.tally), "admitted_keys": len(self.admitted),
                "queued_groups": self.admission.queued_groups(), **self.counts,
                "checkpoint_version": self._ckpt_version, "replay": dict(self.replay),
                "prefetch": dict(self.prefetch.counts) if hasattr(self, "prefetch") else {},
                "idle_fraction": self.idle_s / total if total else None, "last_step": self.last,
                "assignments_by_worker": self.coverage.report(64)}

    # -- crash recovery --------------------------------------------------------------------------

    async def _replay(self, entries: list[JournalEntry]) -> PolicyWeights | None:
        """Replay the journaled steps since the checkpoint (see the module docstring); the weights of the
        newest version reached, when the replay trained (None: the checkpoint's are current)."""
        announced = self.publisher.version
        newest: PolicyWeights | None = None
        identical: bool | None = None
        for entry in entries:
            got = self.admission.take_named(entry.taken, entry.stale) if entry.version == self.version \
                else None
            if got is None:
                log.warning("replay stopped at step %d (v%d): its batches are not all in the inbox",
                            entry.seq, entry.version)
                break
            snap = await self._step(got.taken, got.stale, entry)
            self.replay["steps"] += 1
            if snap is not None:
                newest = snap
                if self.version == announced:
                    expected = self.publisher.announcement()
                    identical = expected is not None and expected[0].checkpoint_hash == snap.content_hash
        if announced is not None and (self.version < announced or
                                      (self.version == announced and identical is False)):
            # Announced versions must keep their content: what we hold goes out as a new version.
            log.warning("replay reached v%d (%s) but v%d was announced: publishing these weights as v%d",
                        self.version, "different weights" if identical is False else "short",
                        announced, announced + 1)
            self.replay.update(outcome="bumped", bumped_from=self.version)
            self.version = announced + 1
            if newest is None:
                newest = await asyncio.to_thread(self._snapshot)
            await self._checkpoint()  # the new numbering outlives the next crash
        elif entries:
            self.replay["outcome"] = "identical" if identical else "replayed"
        if entries:
            log.info("replayed %d journaled steps to v%d (%s)", self.replay["steps"], self.version,
                     self.replay["outcome"])
        return newest

    # -- policy publication ----------------------------------------------------------------------

    async def _publish_current(self, version: int, state: PolicyWeights | None = None) -> None:
        """Make sure ``version`` is published, and announce it. ``state``: that version's weights (the
        model may have moved on since); None only when the version was published before or the model
        still holds it."""
        held = self.publisher.version
        # Published before a restart: the publisher signs its announcement again (the same bytes).
        got = self.publisher.announcement() if held is not None and held >= version else None
        if got is None:
            if state is None:
                state = await asyncio.to_thread(self._snapshot)
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

    async def _publish_in_background(self, version: int, state: PolicyWeights) -> None:
        t0 = time.monotonic()
        try:
            await self._publish_current(version, state)
        except asyncio.CancelledError:
            raise
        except Exception:  # keep training: the next step (or a restart) publishes again
            log.exception("publishing policy v%d failed", version)
            return
        self._published = {"version": version, "time": time.time(), "publish_s": time.monotonic() - t0,
                           **self.publisher.timings}
        self.rt.board.set_policy(current=version, local=version)

    # -- accepted work ---------------------------------------------------------------------------

    def _hop(self, cid: str, hop: str, t: float | None = None) -> None:
        got = self.hops.get(cid) or {}
        got.setdefault(hop, time.time() if t is None else t)
        self.hops.put(cid, got)

    def _on_notice(self, msg: tuple[RolloutNotice, str], origin: str) -> None:
        """A worker's notice: fetch its batch while the validators verify it
        (``roles/trainer/prefetch.py``)."""
        notice, worker = msg
        if self.rt.swarm.is_banned(worker):
            return
        self._heard.put(vote_key(worker, notice.batch_cid), notice.policy_version)  # a ban may name it
        if notice.batch_bytes > MAX_BATCH_SIZE:
            return
        floor = fresh_floor(self.version, self.cfg.run.async_level)
        if self.prefetch.offer(worker, notice.batch_cid, notice.policy_version, notice.batch_bytes, floor,
                               self.version):
            self._hop(notice.batch_cid, "notice")

    async def _prefetch_one(self, worker: str, cid: str, size: int) -> tuple[bytes, RolloutBatch]:
        data = await self.fetcher.fetch(cid, holders=[worker], max_size=MAX_BATCH_SIZE, size=size,
                                        timeout=FETCH_TIMEOUT_S)
        return data, await asyncio.to_thread(decode_batch, data)

    async def _on_verdict(self, msg: tuple[BatchVerdict, str], origin: str) -> None:
        verdict, validator = msg
        late = verdict_time_error(verdict, now_ms())
        if late:  # a replay, or this validator's clock is off: nothing in it is acted on
            self.counts["expired_verdicts"] += 1
            if validator not in self._clock_warned:
                self._clock_warned.add(validator)
                log.warning("verdicts of validator %s ignored: %s (logged once per validator)",
                            validator, late)
            return
        if verdict.ban:
            await self._ban_vote(verdict, validator)
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
        elif decision == "abstain":
            self.counts["abstained_verdicts"] += 1
        elif decision == "admit":
            self._hop(cid, "verdict")
            await self._take_in(verdict, validator)

    async def _take_in(self, verdict: BatchVerdict, validator: str) -> None:
        """Fetch (or take the prefetched copy), check and persist a batch its validators accepted, then
        queue it."""
        w, cid = verdict.worker, verdict.batch_cid
        try:
            acc = await self._admit(verdict, validator)
        except asyncio.CancelledError:
            raise
        except RefusedBatch as exc:
            self.admission.refused(w, cid)
            await self._refuse(verdict, validator, exc)
            return
        except IntellectNodeError as exc:
            self.admission.failed(w, cid)  # another validator's verdict may bring it again
            log.warning("accepted batch %s could not be admitted: %s", cid, exc)
            return
        self._hop(cid, "admitted")
        self.counts["accepted_batches"] += 1
        self.counts["accepted_rollouts"] += verdict.n_accepted
        self.rt.board.verdict(True, verdict.n_accepted, peer=w)
        self.admission.add(acc)
        self._data.set()

    async def _ban_vote(self, verdict: BatchVerdict, validator: str) -> None:
        """One validator's vote to ban the verdict's worker: counted only for a batch that worker announced
        itself (its signed notice was heard here), so no verdict can name an uninvolved peer; the run's
        trainer and validators are never banned this way (``Admission.bans``)."""
        w = verdict.worker
        if self.rt.swarm.is_banned(w):
            return
        if vote_key(w, verdict.batch_cid) not in self._heard:
            log.info("ban of %s by validator %s not counted: no notice of batch %s heard from it", w,
                     validator, verdict.batch_cid)
            return
        self.counts["ban_votes"] += 1
        if self.admission.bans.vote(w, validator):
            await self.rt.swarm.ban(w, f"banned by {self.admission.bans.quorum} validator(s), last "
                                       f"{validator}: {verdict.reason}")
            self.counts["banned"] += 1

    async def _refuse(self, verdict: BatchVerdict, validator: str, exc: RefusedBatch) -> None:
        """A batch its validators accepted that the trainer refuses itself. Rollouts admitted before
        (``duplicate``), of another task (``wrong_task``) or outside its assignment (``not_assigned``) are
        the worker's doing (only it signs its records), so they count against it and ``rl.ban_after`` of
        them ban it; records whose signature is not the worker's (``bad_signature``) are not: whoever
        served them (the validator) is named."""
        w, detail = verdict.worker, str(exc)
        self.counts["rejected_rollouts"] += verdict.n_accepted
        key = {"duplicate": "duplicate_batches", "wrong_task": "wrong_task_batches",
               "bad_signature": "bad_signature_batches",
               "not_assigned": "not_assigned_batches"}.get(exc.reason)
        if key is not None:
            self.counts[key] += 1
        if not exc.workers_fault:
            log.warning("batch %s accepted by validator %s refused: %s (%s); not held against %s",
                        verdict.batch_cid, validator, exc.reason, detail, w)
            return
        n = (self.refusals.get(w) or 0) + 1
        self.refusals.put(w, n)
        self.rt.swarm.peerbook.record_rejection(w, f"batch {verdict.batch_cid}: {exc.reason}: {detail}")
        self.rt.board.verdict(False, verdict.n_accepted, reason=exc.reason, detail=detail, peer=w)
        log.warning("batch %s from %s refused: %s (%s)", verdict.batch_cid, w, exc.reason, detail)
        if n >= self.rl.ban_after and not self.rt.swarm.is_banned(w):
            await self.rt.swarm.ban(w, f"{n} batches refused, last: {exc.reason}")
            self.counts["banned"] += 1

    def _count_stale(self, n: int) -> None:
        self.counts["stale_batches"] += 1
        self.counts["stale_rollouts"] += n

    async def _admit(self, verdict: BatchVerdict, validator: str) -> Accepted:
        w, cid, version = verdict.worker, verdict.batch_cid, verdict.policy_version
        banned = self.rt.swarm.is_banned(w)  # accepted before its ban: the validator holds the batch
        got = await self.prefetch.claim(w, cid, wait=not banned)
        if got is not None:
            data, batch, arrived = got
            self._hop(cid, "prefetched", arrived)
        else:  # not prefetched (or that failed): from the worker or the validator, which holds it
            data = await self.fetcher.fetch(cid, holders=[validator] if banned else [w, validator],
                                            max_size=MAX_BATCH_SIZE, timeout=FETCH_TIMEOUT_S)
            batch = await asyncio.to_thread(decode_batch, data)
        # re-scoring runs checkers (math-verify: ~12 ms a rollout, up to rl.reward_timeout_s on hostile
        # text): off the event loop
        groups = await asyncio.to_thread(self._groups, batch, w, version)
        window = self.assignments.window_of(w, version, batch.rollouts[0].problem_id)
        if window is not None:  # always: _groups refuses a batch outside the worker's assignment
            self.coverage.add(w, version, window)
        seq = await self.inbox.admit(cid, w, version, data, rollout_keys(batch.rollouts))
        return Accepted(cid, w, version, groups, seq)

    def _groups(self, batch: RolloutBatch, worker: str, version: int) -> list[list[Sample]]:
        recs = batch.rollouts
        if batch.run_id != self.run_id or batch.policy_version != version \
                or any(r.worker != worker for r in recs):
            raise ProtocolError("batch does not match its verdict")
        for i, r in enumerate(recs):  # the worker's own records, not ones planted under its name
            try:
                verify_rollout_signature(r)
            except ProtocolError as exc:
                raise RefusedBatch(f"record {i}: {exc}", reason="bad_signature",
                                   workers_fault=False) from None
        wrong = wrong_task(self.task, recs)
        if wrong:
            raise RefusedBatch(wrong, reason="wrong_task")
        slices = group_slices(recs, self.rl.group_size)
        if isinstance(slices, str):
            raise ProtocolError(slices)
        window = self.assignments.check(worker, version, [r.problem_id for r in recs], self.rl.group_size)
        if isinstance(window, str):
            raise RefusedBatch(window, reason="not_assigned")
        out = []
        shown: list[Completion] = []
        texts: list[str] = []

        def decode(ids: list[int]) -> str:  # the re-scoring's own decode, its texts kept for the status
            text = self.tokenizer.decode(ids)
            texts.append(text)
            return text

        for sl in slices:
            problem = self.task.get(recs[sl.start].problem_id)
            texts.clear()
            group = rescored_group(recs[sl], problem, decode)
            if group is None:  # a reward this node could not judge in time: the group is left out
                self.counts["unjudged_groups"] += 1
                log.warning("batch of %s at v%d: a group of %s left out (the reward checker timed out here)",
                            worker, version, recs[sl.start].problem_id)
                continue
            out.append(group)
            shown.append(completion(problem, texts[0], group[0].reward, policy_version=version,
                                    worker=worker))
            if not self._answer_mode:
                how = getattr(problem.scorer, "extraction", None)
                self._answer_mode = how.mode if isinstance(how, Extraction) else "whole"
        self._shown.extend(shown)
        self.rt.board.completions(shown)
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
        if self.opt is None:  # a fresh start (see start): built while the first batches are made
            self.opt = await asyncio.to_thread(self._optimizer)
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
            snap = await self._step(got.taken, got.stale)
            if snap is not None:
                await self._publish_next(snap)
            now = time.monotonic()
            self.busy_s += now - t_mark
            t_mark = now
        if self._ckpt_version != self.version:  # max_steps reached: the end state is checkpointed
            await self._checkpoint()
        if self._publishing is not None:  # and the last version goes out before we idle
            await self._publishing

    async def _publish_next(self, snap: PolicyWeights) -> None:
        """Publish the version just trained beside the next step (``_step`` waited for the previous
        publication: one at a time, in version order)."""
        self._publishing = self.tasks.job(self._publish_in_background(self.version, snap),
                                          f"publishing policy v{self.version}")

    def _optimizer(self, ckpt: Path | None = None) -> Optimizer:
        """AdamW over the model, holding the optimizer state of the latest checkpoint under ``ckpt`` when it
        has one (worker thread: the state is read here, off the event loop)."""
        opt = make_optimizer(self.model, self.rl.lr)
        saved = read_optimizer(ckpt) if ckpt is not None else None
        if saved is not None:
            opt.load_state_dict(saved)
        return opt

    def _train(self, samples: list[Sample]) -> tuple[StepStats, PolicyWeights]:
        """The optimizer step, then a copy of the new weights in canonical policy bytes (worker thread):
        what gets published while the next step moves the weights."""
        assert self.opt is not None, "the training loop builds the optimizer before any step"
        stats = train_step(self.model, self.opt, samples, self.gcfg, temperature=self.rl.temperature,
                           micro_tokens=self.train_options.micro_batch_tokens,
                           compute_dtype=self.train_options.compute_dtype)
        return stats, self._snapshot()

    def _snapshot(self) -> PolicyWeights:
        return PolicyWeights.from_state_dict(self.model.state_dict())

    async def _step(self, taken: list[Accepted], stale: list[Accepted],
                    entry: JournalEntry | None = None) -> PolicyWeights | None:
        """One step on ``taken`` (``entry``: replaying that journaled step); the new weights, or None when
        no group carried a signal (nothing trained, no new version)."""
        t_taken = time.time()
        if entry is None:  # the recipe of the version about to be made is on disk before it exists
            entry = await asyncio.to_thread(self.journal.append, self.version, [a.cid for a in taken],
                                            [a.cid for a in stale])
        groups = [g for a in taken for g in a.groups]
        samples_all = [s for g in groups for s in g]
        filtered = filter_groups(groups, lambda s: s.reward)
        useful = filtered.useful
        ids = [a.cid for a in taken] + [a.cid for a in stale]
        # in memory; on disk at the next checkpoint, the journal until then
        self.consumed.update((a.cid, a.version) for a in (*taken, *stale))
        self._undropped.update(ids)
        record = self.metrics.records(entry.seq)
        if not useful:
            # Nothing to learn from: the batches are consumed all the same (the workers make new ones),
            # and the attempt is counted, so a run that never trains says why (module docstring).
            if record:
                self._record(None, samples_all, filtered, taken, stale, entry.seq)
            self._attempted(filtered, samples_all)
            return None
        samples = [s for g in useful for s in g]
        t0 = time.monotonic()
        stats, snap = await asyncio.to_thread(self._train, samples)
        t1 = time.monotonic()
        if self._publishing is not None:  # the previous version's, started a step ago: usually done
            await self._publishing
        t_wait = time.monotonic() - t1
        self.version += 1
        self.step += 1
        # Where a step's time goes (seconds): the optimizer step with the weights' copy; publish_s is the
        # last finished publication's (it runs beside the next step), publish_wait_s how long this step
        # waited for it to finish; checkpoint_s the checkpoint written after the previous step's line (0
        # when none was).
        self._timing = {"train_s": t1 - t0, "publish_wait_s": t_wait, "checkpoint_s": self._checkpoint_s,
                        "publish_s": self._published.get("publish_s", 0.0),
                        "taken_t": t_taken, "trained_t": time.time()}
        self._checkpoint_s = 0.0
        # The step's line goes out before a checkpoint that covers the step: killed between the two, the
        # trainer replays the journaled step and finds it recorded; the other way round, the checkpoint
        # would hold a step whose line was never written (and no replay would write it).
        if record:
            self._record(stats, samples_all, filtered, taken, stale, entry.seq)
        self._attempted(filtered, samples_all)
        if self.version - self._ckpt_version >= self.rl.checkpoint_every:
            t_ckpt = time.monotonic()
            await self._checkpoint()
            self._checkpoint_s = time.monotonic() - t_ckpt
        # Rollouts older than async_level are refused as stale from now on: their keys can go.
        await self.admitted.compact(fresh_floor(self.version, self.cfg.run.async_level))
        self._forget_old()
        return snap

    def _forget_old(self) -> None:
        """Bound what grows with the run: decisions on stale batches, and consumed IDs past the window."""
        self.admission.forget_below(self.version)
        floor = self.version - CONSUMED_KEEP_VERSIONS
        if any(v < floor for v in self.consumed.values()):
            self.consumed = {c: v for c, v in self.consumed.items() if v >= floor}

    async def _checkpoint(self) -> None:
        """Commit the model, optimizer and consumed set; then drop what the checkpoint now holds: the inbox
        copies of the batches consumed since the last one and the journal entries up to now."""
        covered = self.journal.seq
        saved = TrainerState(version=self.version, consumed=frozenset(self.consumed), step=self.step,
                             extra={"journal_seq": covered})
        await asyncio.to_thread(save_checkpoint, self.dir / "checkpoints", self.model, self.opt, saved)
        self._ckpt_version = self.version
        for cid in self._undropped:
            self.inbox.drop(cid)
        self._undropped = set()
        await asyncio.to_thread(self.journal.trim, covered)

    def _attempted(self, filtered: FilteredGroups[Sample], samples: list[Sample]) -> None:
        """Report a step attempt to the status board; log the no-signal warning once per streak, when
        the board raises it."""
        cause = filtered.cause
        hint = self._no_signal_hint(cause, samples) if cause else ""
        self.rt.board.train_attempt(groups=filtered.total, filtered=filtered.dropped, cause=cause, hint=hint)
        if not cause:
            self._no_signal_logged = False
            return
        warning = self.rt.board.snapshot().training.no_signal_warning
        if warning and not self._no_signal_logged:
            log.warning("%s", warning)
            self._no_signal_logged = True

    def _no_signal_hint(self, cause: str, samples: list[Sample]) -> str:
        """The likely causes of an attempt with no learnable group, naming the settings to check."""
        rl = self.rl
        if cause == "all_zero":
            cut = sum(1 for s in samples if len(s.completion_ids) >= rl.max_new_tokens) / max(len(samples), 1)
            shown = list(self._shown)
            missing = sum(1 for c in shown if c.answer is None)
            mode = self._answer_mode or "whole"
            fmt = f"auto: {mode}" if rl.answer_format == "auto" else rl.answer_format
            return (f"every reward 0: completions too short (rl.max_new_tokens {rl.max_new_tokens}, "
                    f"{cut:.0%} reach it), an answer format the model does not write (rl.answer_format "
                    f"{fmt}, no answer in {missing}/{len(shown)}), or a task too hard for the model; "
                    "see the recent completions")
        if cause == "all_one":
            return ("every reward 1: the task is too easy for the model; raise its difficulty (rl.env_args) "
                    "or pick a harder task (rl.task, rl.tasks_file)")
        if cause == "all_equal":
            return ("each group's rewards are equal (problems always or never solved, or partial credit "
                    "alike): spread the difficulty (rl.env_args), or vary the samples more (rl.temperature "
                    f"{rl.temperature}, rl.group_size {rl.group_size})")
        return (f"no group could be judged: the reward checker ran out of time on each "
                f"(rl.reward_timeout_s {rl.reward_timeout_s})")

    def _record(self, stats: StepStats | None, samples: list[Sample], filtered: FilteredGroups[Sample],
                taken: list[Accepted], stale: list[Accepted], seq: int) -> None:
        rewards = [s.reward for s in samples]
        pass_rate = sum(1 for r in rewards if r >= 1.0) / max(len(rewards), 1)
        reward_mean = sum(rewards) / max(len(rewards), 1)
        # Staleness: how many versions behind the weights being updated each sample's policy was.
        base = self.version - (1 if stats is not None else 0)
        stale_v = [base - s.policy_version for s in samples]
        total = self.idle_s + self.busy_s
        batches = sorted([a.cid for a in taken] + [a.cid for a in stale])
        # Each taken batch's hops (wall-clock seconds): notice heard, prefetched, verdict heard, admitted.
        hops = {a.cid: {"worker": a.worker, **(self.hops.get(a.cid) or {})} for a in taken}
        line = {"step": self.step, "version": self.version, "trained": stats is not None, "time": time.time(),
                "seq": seq, "pass_rate": pass_rate, "reward_mean": reward_mean, "samples": len(samples),
                "groups": filtered.total, "groups_used": len(filtered.useful),
                "filtered_fraction": filtered.dropped / filtered.total if filtered.total else 1.0,
                "no_signal": filtered.cause,
                "loss": stats.loss if stats else 0.0, "grad_norm": stats.grad_norm if stats else 0.0,
                "clipped_frac": stats.clipped_frac if stats else 0.0,
                "staleness_mean": sum(stale_v) / max(len(stale_v), 1),
                "staleness_max": max(stale_v, default=0),
                "accepted": self.counts["accepted_rollouts"], "rejected": self.counts["rejected_rollouts"],
                "stale": self.counts["stale_rollouts"],
                "idle_fraction": self.idle_s / total if total else 0.0,
                "batches": batches, "hops": hops, "published": dict(self._published),
                **(self._timing if stats is not None else {})}
        self.last = line
        self.metrics.write(line, seq)
        if stats is not None:
            self.rt.board.train_step(self.step, reward_mean=reward_mean, pass_rate=pass_rate)
        log.info("step %d -> v%d: pass %.3f reward %.3f (%d samples, %d/%d groups, staleness %.2f)%s",
                 self.step, self.version, pass_rate, reward_mean, len(samples), len(filtered.useful),
                 filtered.total, line["staleness_mean"],
                 f": no learnable group ({filtered.cause}), nothing trained" if filtered.cause else "")
