"""Trainer role: GRPO on accepted rollouts, bounded staleness, atomic policy publication, resume.

The parts, each in its own module; none of them references the ``Trainer``, which builds them in
``__init__``/``start`` and wires them together in this one place:

- ``intake.py``: ``BatchIntake``, the gossip handlers of notices and verdicts: a batch from a worker's
  notice to the training queue, bans and refusals on the way;
- ``admission.py``: ``Admission``, the pure state machine deciding which verdicts take a batch in and
  which queued batches form a step (its tallies and queued batches are in ``batching.py``);
- ``prefetch.py``: ``Prefetch``, the batches named by workers' notices, fetched while validators verify
  (the intake holds it);
- ``inbox.py``: ``Inbox``, the admitted batches on disk until a checkpoint holds them, and
  ``StepJournal``, the steps taken since that checkpoint; ``admitted.py``: ``AdmittedJournal``, the
  rollout keys admitted per version (the inbox holds it);
- ``replay.py``: ``replay_steps``, the journaled steps taken again after a crash;
- ``publication.py``: ``Publication``, each version published once, in order, and the newest repeated;
- ``records.py``: ``StepRecords``, each step's signed record (``protocol/steps.py``: base and new policy,
  batches and groups trained, settings), gossiped on the run's ``steps`` topic and stored as a blob;
- ``nosignal.py``: ``NoSignal``, step attempts with no learnable group reported, with a hint;
- ``stepcheck.py``: ``StepCheck``, a step too large for its trust region (KL or cut fraction) reported;
- ``metrics.py``: ``MetricsFile``, ``trainer/metrics.jsonl`` and the last journaled step it recorded;
- ``mirrors.py``: ``Mirrors``, each metrics line copied to W&B and TensorBoard (``[logging]``), on a
  thread of its own;
- from ``roles/common/``: ``Rescorer`` (``rescore.py``), an accepted batch checked again and re-scored
  from the task (an auditor re-checks with it too), the step's GRPO settings (``grpo.py``),
  ``PolicyPublisher`` (``policy.py``), ``HintedFetcher`` (``fetch.py``), the
  run's task (``tasks.py``), and ``RoleTasks`` (``seams.py``) for the train and announce loops and the
  publications.

The Trainer itself holds the training loop, the checkpoints and the status it reports:

- **Bounded asynchrony.** The trainer at policy version v trains only on rollouts generated with a
  version >= v - ``run.async_level`` (INTELLECT-2: 2); older ones are refused (counted as stale). It
  takes whichever accepted batches are queued, from any workers, as soon as ``rl.groups_per_step``
  groups are there: it never waits for a particular worker. It trains only on batches accepted by
  ``run.verdict_quorum`` of the run's validators (``run.validator_peer_ids``).
- **A step.** The batches it takes are journaled first (``trainer/steps.jsonl``, fsynced), then the online
  filter (drop groups whose rewards are all equal) and the GRPO step of ``trainer/step.py`` run in a
  worker thread, which also copies the new weights into canonical policy bytes before the next step can
  move them. Version v+1 is published from that copy beside the next optimizer step. A step whose groups
  all have equal rewards trains nothing (``nosignal.py``). A step whose loss or gradient is not finite
  moves no weight; each of its batches is then tried alone, and one not finite alone is held against
  its worker (``nonfinite``, through the intake, like ``duplicate``). A line per step goes to
  ``trainer/metrics.jsonl``, with the timestamps of each batch's hops (notice heard, prefetched, verdict
  heard, admitted) and of the step's.
- **Checkpoints.** Every ``rl.checkpoint_every`` steps (and at least every ``run.audit_checkpoint_every``
  trained steps since the last state published: the run's audit coverage rule, which every node checks) the
  weights, AdamW state and consumed batch IDs are checkpointed atomically (``trainer/checkpoint.py``); then
  the inbox copies of the batches it holds and the journal entries it covers go, and the step's record goes
  out naming the checkpoint's weights and optimizer state as blobs (``records.py``: where an auditor's window
  can start). After SIGKILL the trainer reloads the latest checkpoint (same version numbering), re-queues
  every inbox batch not in its consumed set (none lost, none trained twice), replays the journaled steps since
  the checkpoint (``replay.py``) and re-announces (or publishes) the newest version.

Shortcuts: one optimizer step per batch of groups (no PPO epochs); the trainer does not verify proofs
itself, it relies on the validators it was configured to trust.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

import torch

from intellect_node.config.status import StepDiagnostics
from intellect_node.errors import ConfigError
from intellect_node.models.loader import ModelTokenizer
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.binding import announcement_bindings
from intellect_node.protocol.policy import POLICY_KIND
from intellect_node.protocol.rl import NOTICE_KIND, VERDICT_KIND, notice_validator, verdict_validator
from intellect_node.protocol.rollout import MAX_BATCH_SIZE
from intellect_node.protocol.steps import ACCEPT_ENVELOPE_BYTES, MAX_EVIDENCE_BYTES, STEP_KIND, StepSettings
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.fetch import ANNOUNCE_MIN_CHUNKS, HintedFetcher
from intellect_node.roles.common.grpo import run_grpo_config, settings_of
from intellect_node.roles.common.models import model_dir
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.roles.common.rescore import Rescorer
from intellect_node.roles.common.seams import RoleTasks, Runtime
from intellect_node.roles.common.services import blob_service
from intellect_node.roles.common.tasks import run_assignments, run_task
from intellect_node.roles.trainer.admission import Admission
from intellect_node.roles.trainer.batching import Accepted, Step, fresh_floor
from intellect_node.roles.trainer.inbox import Inbox, JournalEntry, StepJournal
from intellect_node.roles.trainer.intake import BatchIntake, with_envelope
from intellect_node.roles.trainer.metrics import MetricsFile, StepLine, StepTiming
from intellect_node.roles.trainer.mirrors import Mirrors, mirror_openers
from intellect_node.roles.trainer.nosignal import NoSignal
from intellect_node.roles.trainer.publication import Publication
from intellect_node.roles.trainer.records import StateFiles, StepRecords, build_record
from intellect_node.roles.trainer.replay import Announced, replay_steps
from intellect_node.roles.trainer.stepcheck import StepCheck
from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, read_optimizer, save_checkpoint
from intellect_node.trainer.filtering import FilteredGroups, filter_groups
from intellect_node.trainer.optim import Optimizer
from intellect_node.trainer.step import Sample, StepStats, finite_alone, make_optimizer, train_step
from intellect_node.trainer.stepsize import measured, next_scale, step_lr

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 60.0
ADMITTED_FILE = "admitted.jsonl"
JOURNAL_FILE = "steps.jsonl"
CONSUMED_KEEP_VERSIONS = 64
"""Consumed batch IDs are kept (in memory and in each checkpoint) for this many policy versions: a verdict
on an older batch is refused as stale anyway (``run.async_level`` is at most 16), and the set no longer
grows with the length of the run."""


class TrainerUsage(TypedDict):
    """What became of the accepted batches (:meth:`Trainer.status`)."""

    taken_batches: int
    taken_by_age: dict[str, int]
    """Batches taken into a step attempt by their age in versions, the age as a string (a JSON key)."""
    taken_fraction: float | None


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
        if cfg.rl.groups_per_step * cfg.run.verdict_quorum * ACCEPT_ENVELOPE_BYTES > MAX_EVIDENCE_BYTES:
            raise ConfigError(f"rl.groups_per_step x run.verdict_quorum is {cfg.rl.groups_per_step} x "
                              f"{cfg.run.verdict_quorum}: a step record could not carry the acceptances of "
                              f"its batches (at most {MAX_EVIDENCE_BYTES // ACCEPT_ENVELOPE_BYTES}); lower "
                              "one of them", field="rl.groups_per_step")
        self.task = run_task(cfg)
        self.assignments = run_assignments(cfg, self.task)  # each batch must be one of its worker's windows
        self.tokenizer = ModelTokenizer(model_dir(cfg))
        self.dir = Path(runtime.data_dir) / "trainer"
        self.inbox = Inbox(self.dir / "inbox", self.dir / ADMITTED_FILE)  # admitted work, across crashes
        self.admitted = self.inbox.admitted  # rollout keys admitted, per version
        self.journal = StepJournal(self.dir / JOURNAL_FILE)  # the steps since the last checkpoint
        self.gcfg = run_grpo_config(self.rl)
        # Verdicts never ban the run's own trainer and validators (one validator could otherwise ban them).
        protected = frozenset({runtime.swarm.peer_id, *cfg.run.validator_peer_ids})
        self.admission = Admission(quorum=cfg.run.verdict_quorum, async_level=cfg.run.async_level,
                                   groups_per_step=self.rl.groups_per_step,
                                   allowed=frozenset(cfg.run.worker_allowlist), protected=protected)
        self.rescorer = Rescorer(self.task, self.tokenizer.decode, run_id=self.run_id,
                                 group_size=self.rl.group_size, board=runtime.board,
                                 assignments=self.assignments)
        self.consumed: dict[str, int] = {}  # batch CID -> policy version (CONSUMED_KEEP_VERSIONS kept)
        self._data = asyncio.Event()  # a batch was queued
        self.intake = BatchIntake(swarm=runtime.swarm, board=runtime.board, admission=self.admission,
                                  inbox=self.inbox, rescorer=self.rescorer, fetch=self._fetch,
                                  version=lambda: self.version, consumed=lambda cid: cid in self.consumed,
                                  on_queued=self._data.set, async_level=cfg.run.async_level,
                                  ban_after=self.rl.ban_after)
        self.no_signal = NoSignal(runtime.board, self.rl)
        self.step_check = StepCheck(self.rl)  # a step too large for its trust region, said so
        self.mirrors = Mirrors(mirror_openers(cfg, self.dir))  # start() opens them, close() closes them
        self.fetcher: HintedFetcher | None = None  # start() makes it (it needs the blob service)
        self.opt: Optimizer | None = None  # start() loads it, or the training loop makes the first
        self.records: StepRecords | None = None  # start() makes it (it needs the blob service)
        self._head_hash = ""  # the current version's checkpoint hash: the next step record's base
        self._undropped: set[str] = set()  # consumed, inbox copy kept until a checkpoint holds it
        self.version = 0
        self.step = 0
        self.lr_scale = 1.0  # the adaptive step's scale for the next step (trainer/stepsize.py)
        self._ckpt_version = 0
        self._state_step = 0  # the step of the newest checkpoint state published (run.audit_every's)
        self.tasks = RoleTasks(runtime, "trainer")  # the train and announce loops; publications
        self.replay: dict[str, int | str] = {"steps": 0, "outcome": "none"}
        self.idle_s = 0.0
        # batches taken into a step attempt, by their age in versions at that step (0: the policy it updates)
        self.taken_by_age: dict[int, int] = {}
        self.busy_s = 0.0
        self.last: StepLine | None = None
        self._timing: StepTiming | None = None
        self._checkpoint_s = 0.0  # the last checkpoint's seconds, reported on the next step's line

    @classmethod
    def for_runtime(cls, runtime: Runtime) -> "Trainer":
        return cls(runtime)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        from intellect_node.trainer.model import TrainOptions, load_trainable

        torch.set_num_threads(1)
        blobs = blob_service(self.rt)
        self.fetcher = HintedFetcher(blobs, self.rt.swarm)
        self.train_options = TrainOptions.from_section(self.rl)  # fp32 on the CPU unless the config says
        self.model = await asyncio.to_thread(load_trainable, model_dir(self.cfg), self.train_options)
        covered = await self._load_checkpoint()
        self._ckpt_version = self.version
        self.journal.seq = max(self.journal.seq, covered)  # a trimmed journal numbers on from the checkpoint
        self.metrics = MetricsFile(self.dir)  # replayed steps are not recorded twice
        self.mirrors.start()  # before the replay: the steps it records are mirrored too
        self._reload_inbox()
        await self.admitted.compact(fresh_floor(self.version, self.cfg.run.async_level))
        publisher = PolicyPublisher(self.dir / "policy", blobs, self.rt.swarm.key, self.run_id,
                                    full_every=self.rl.full_every,
                                    chunk_size=int(self.rl.policy_chunk_mib * (1 << 20)),
                                    announce_min_chunks=ANNOUNCE_MIN_CHUNKS)
        self.publication = Publication(publisher, self.rt.swarm, topic(self.run_id, POLICY_KIND), self.dir,
                                       self.rt.board, self.tasks, self._snapshot)
        self.records = StepRecords(key=self.rt.swarm.key, swarm=self.rt.swarm, blobs=blobs,
                                   topic=topic(self.run_id, STEP_KIND), directory=self.dir, tasks=self.tasks)
        self._head_hash = (await asyncio.to_thread(self._snapshot)).content_hash  # the records' base
        self._state_step = self.records.newest_state_step(default=self.step)
        await self.tasks.open()
        newest = await self._replay(self.journal.after(covered), publisher)
        await self.publication.current(self.version, newest)
        self.rt.board.set_policy(current=self.version, local=self.version)
        trusted = frozenset(self.cfg.run.validator_peer_ids)
        self.rt.swarm.subscribe(topic(self.run_id, VERDICT_KIND),
                                with_envelope(verdict_validator(self.run_id, trusted,
                                                                on_ignored=self.intake.verdict_late)),
                                self.intake.on_verdict)
        allowed = frozenset(self.cfg.run.worker_allowlist) or None
        self.rt.swarm.subscribe(topic(self.run_id, NOTICE_KIND), notice_validator(self.run_id, allowed),
                                self.intake.on_notice)
        self.tasks.loop("trainer-loop", self._train_loop, may_end=True)  # ends at max_steps
        self.tasks.loop("trainer-announce", self.publication.repeat)

    async def close(self) -> None:
        await self.tasks.close()
        self.intake.prefetch.close()
        if self.fetcher is not None:
            self.fetcher.close()
        await asyncio.to_thread(self.mirrors.close)  # after the loops: every line recorded is mirrored

    def status(self) -> dict[str, object]:
        total = self.idle_s + self.busy_s
        return {"version": self.version, "step": self.step, "queued_batches": len(self.admission.queue),
                "awaiting_quorum": len(self.admission.tally), "admitted_keys": len(self.admitted),
                "queued_groups": self.admission.queued_groups(), **self.intake.counts,
                **self._usage(),
                "unjudged_groups": self.rescorer.unjudged,
                "checkpoint_version": self._ckpt_version, "replay": dict(self.replay),
                "records": self.records.status() if self.records is not None else {},
                "prefetch": dict(self.intake.prefetch.counts),
                "idle_fraction": self.idle_s / total if total else None, "last_step": self.last or {},
                "mirrors": self.mirrors.status(),
                "assignments_by_worker": self.intake.coverage.report(64)}

    def _usage(self) -> TrainerUsage:
        """What became of the accepted batches: how many a step took, at which age (versions behind the
        policy the step updated; never above ``run.async_level``), and the fraction of the accepted ones
        that is (the rest: queued, or dropped as stale)."""
        taken = sum(self.taken_by_age.values())
        accepted = self.intake.counts["accepted_batches"]
        ages = {str(k): v for k, v in sorted(self.taken_by_age.items())}
        return {"taken_batches": taken, "taken_by_age": ages,
                "taken_fraction": taken / accepted if accepted else None}

    async def _fetch(self, cid: str, holders: Sequence[str], size: int | None) -> bytes:
        """A batch blob for the intake (a notice's size when known)."""
        if self.fetcher is None:
            raise RuntimeError("the trainer fetches batches once started")
        return await self.fetcher.fetch(cid, holders=holders, max_size=MAX_BATCH_SIZE, size=size,
                                        timeout=FETCH_TIMEOUT_S)

    # -- checkpoints and crash recovery ----------------------------------------------------------

    async def _load_checkpoint(self) -> int:
        """Resume from the latest checkpoint (or write version 0's); the journal sequence it covers."""
        ckpt = self.dir / "checkpoints"
        state = await asyncio.to_thread(load_checkpoint, ckpt, self.model)
        if state is None:
            # Version 0's checkpoint holds the weights alone: an optimizer has no state before its first
            # step. The training loop builds it while the first batches are made, after v0 is out: on a
            # GPU, torch.optim imports torch._dynamo then (about 1 s of one core; trainer/optim.py).
            await asyncio.to_thread(save_checkpoint, ckpt, self.model, None,
                                    TrainerState(version=0, extra={"journal_seq": self.journal.seq}))
            return self.journal.seq
        self.opt = await asyncio.to_thread(self._optimizer, ckpt)
        # The checkpoint does not say each batch's version: they count as the checkpoint's own.
        self.version, self.step = state.version, state.step
        self.consumed = dict.fromkeys(state.consumed, state.version)
        self.lr_scale = float(state.extra.get("lr_scale", 1.0))
        log.info("resumed at policy v%d (step %d, %d batches consumed)", self.version, self.step,
                 len(self.consumed))
        return int(state.extra.get("journal_seq", 0))

    def _reload_inbox(self) -> None:
        """After a restart: queue every persisted batch not in the checkpoint's consumed set."""
        found = self.inbox.reload(self.consumed, self.rescorer.groups)
        for acc in found:
            self.admission.add(acc)
        if found:
            log.info("re-queued %d accepted batches from the inbox", len(found))
            self._data.set()

    async def _replay(self, entries: list[JournalEntry], publisher: PolicyPublisher) -> PolicyWeights | None:
        """Replay the journaled steps since the checkpoint (``replay.py``); the weights of the newest
        version reached, when the replay trained (None: the checkpoint's are current)."""
        ann = publisher.announcement()
        announced = Announced(ann[0].version, ann[0].checkpoint_hash) if ann is not None else None
        if self.records is not None:  # what was signed before, records too: never bound again otherwise
            if ann is not None:
                self.records.bound(announcement_bindings(ann[0]))
            signed = self.records.newest_bound()
            if signed is not None and (announced is None or signed[0] > announced.version):
                announced = Announced(*signed)  # a record went out before its version's announcement

        async def train(step: Step, entry: JournalEntry) -> PolicyWeights | None:
            return await self._step(step.taken, step.stale, entry)

        done = await replay_steps(entries, version=lambda: self.version,
                                  take=lambda e: self.admission.take_named(e.taken, e.stale), train=train,
                                  announced=announced)
        self.replay = {"steps": done.steps, "outcome": done.outcome}
        newest = done.newest
        if done.bump_to is not None:
            self.replay["bumped_from"] = self.version
            self.version = done.bump_to
            if newest is None:
                newest = await asyncio.to_thread(self._snapshot)
            await self._checkpoint()  # the new numbering outlives the next crash
        return newest

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
                self.intake.count_stale(sum(len(g) for g in a.groups))
            snap = await self._step(got.taken, got.stale)
            if snap is not None:  # published beside the next step (which waits for it first)
                self.publication.next(self.version, snap)
            now = time.monotonic()
            self.busy_s += now - t_mark
            t_mark = now
        if self._ckpt_version != self.version:  # max_steps reached: the end state is checkpointed
            await self._checkpoint()
        await self.publication.wait()  # and the last version goes out before we idle

    def _optimizer(self, ckpt: Path | None = None) -> Optimizer:
        """AdamW over the model, holding the optimizer state of the latest checkpoint under ``ckpt`` when it
        has one (worker thread: the state is read here, off the event loop)."""
        opt = make_optimizer(self.model, self.rl.lr)
        saved = read_optimizer(ckpt) if ckpt is not None else None
        if saved is not None:
            opt.load_state_dict(saved)
        return opt

    def _settings(self) -> StepSettings:
        """The next step's settings, with the lr it trains at (``trainer/stepsize.py``)."""
        lr = step_lr(self.rl.lr, self.step, self.rl.lr_warmup_steps, self.lr_scale)
        return settings_of(self.gcfg, lr=lr, temperature=self.rl.temperature,
                           micro_tokens=self.train_options.micro_batch_tokens,
                           compute_dtype=self.train_options.compute_dtype,
                           warmup_steps=self.rl.lr_warmup_steps, target_kl=self.rl.target_kl,
                           lr_scale=self.lr_scale)

    def _train(self, samples: list[Sample], lr: float) -> tuple[StepStats, PolicyWeights]:
        """The optimizer step at ``lr``, then a copy of the new weights in canonical policy bytes (worker
        thread): what gets published while the next step moves the weights."""
        assert self.opt is not None, "the training loop builds the optimizer before any step"
        stats = train_step(self.model, self.opt, samples, self.gcfg, temperature=self.rl.temperature,
                           micro_tokens=self.train_options.micro_batch_tokens,
                           compute_dtype=self.train_options.compute_dtype, lr=lr)
        return stats, self._snapshot()

    def _snapshot(self) -> PolicyWeights:
        return PolicyWeights.from_state_dict(self.model.state_dict())

    async def _charge_nonfinite(self, taken: list[Accepted], useful: Sequence[Sequence[Sample]]) -> None:
        """A step skipped for a non-finite loss or gradient (no weights moved): each batch's groups are
        tried alone (``trainer.step.finite_alone``), and a batch not finite alone is held against its
        worker (``nonfinite``) like a failed check. When none is (only their sum overflowed), no one is."""
        kept = {id(g) for g in useful}
        culprits = []
        for a in taken:
            samples = [s for g in a.groups if id(g) in kept for s in g]
            if samples and not await asyncio.to_thread(
                    finite_alone, self.model, samples, self.gcfg, temperature=self.rl.temperature,
                    micro_tokens=self.train_options.micro_batch_tokens,
                    compute_dtype=self.train_options.compute_dtype):
                culprits.append(a)
        if not culprits:
            log.warning("step skipped: its loss or gradient was not finite, though no batch's is alone")
        for a in culprits:
            await self.intake.charge(a.worker, a.cid, "nonfinite", "its loss or gradient is not finite",
                                     sum(len(g) for g in a.groups))

    async def _step(self, taken: list[Accepted], stale: list[Accepted],
                    entry: JournalEntry | None = None) -> PolicyWeights | None:
        """One step on ``taken`` (``entry``: replaying that journaled step); the new weights, or None when
        no group carried a signal (nothing trained, no new version)."""
        t_taken = time.time()
        replaying = entry is not None  # a journaled step again: its batches were charged the first time
        if entry is None:  # the recipe of the version about to be made is on disk before it exists
            dropped = self.intake.drain_dropped([a.cid for a in (*taken, *stale)])
            entry = await asyncio.to_thread(self.journal.append, self.version, [a.cid for a in taken],
                                            [a.cid for a in stale], dropped)
        groups = [g for a in taken for g in a.groups]
        samples_all = [s for g in groups for s in g]
        filtered = filter_groups(groups, lambda s: s.reward)
        useful = filtered.useful
        ids = [a.cid for a in taken] + [a.cid for a in stale]
        # in memory; on disk at the next checkpoint, the journal until then
        self.consumed.update((a.cid, a.version) for a in (*taken, *stale))
        if not replaying:
            for a in taken:
                age = self.version - a.version
                self.taken_by_age[age] = self.taken_by_age.get(age, 0) + 1
        self._undropped.update(ids)
        record = self.metrics.records(entry.seq)
        settings = self._settings()
        if not useful:
            # Nothing to learn from: the batches are consumed all the same (the workers make new ones),
            # and the attempt is counted, so a run that never trains says why (module docstring).
            if record:
                self._record(None, samples_all, filtered, taken, stale, entry.seq)
            self._attempted(filtered, samples_all)
            self._step_record(entry, taken, stale, filtered, self._head_hash, settings)
            return None
        samples = [s for g in useful for s in g]
        t0 = time.monotonic()
        stats, snap = await asyncio.to_thread(self._train, samples, settings.lr)
        t1 = time.monotonic()
        kl = measured(stats.kl_sampler, (s.policy_version for s in samples), self.version)
        self.lr_scale = next_scale(self.lr_scale, kl, self.rl.target_kl)
        if stats.skipped and not replaying:
            await self._charge_nonfinite(taken, useful)
        await self.publication.wait()  # the previous version's, started a step ago: usually done
        t_wait = time.monotonic() - t1
        self.version += 1
        self.step += 1
        # Where a step's time goes (seconds): the optimizer step with the weights' copy; publish_s is the
        # last finished publication's (it runs beside the next step), publish_wait_s how long this step
        # waited for it to finish; checkpoint_s the checkpoint written after the previous step's line (0
        # when none was).
        self._timing = {"train_s": t1 - t0, "publish_wait_s": t_wait, "checkpoint_s": self._checkpoint_s,
                        "publish_s": self.publication.published.get("publish_s", 0.0),
                        "taken_t": t_taken, "trained_t": time.time()}
        self._checkpoint_s = 0.0
        # The step's line goes out before a checkpoint that covers the step: killed between the two, the
        # trainer replays the journaled step and finds it recorded; the other way round, the checkpoint
        # would hold a step whose line was never written (and no replay would write it).
        if record:
            self._record(stats, samples_all, filtered, taken, stale, entry.seq)
        self._attempted(filtered, samples_all)
        state = None
        if self._checkpoint_due():
            t_ckpt = time.monotonic()
            state = await self._checkpoint(publish=True)
            self._checkpoint_s = time.monotonic() - t_ckpt
            if state is not None:
                self._state_step = self.step
        # After the checkpoint: the record of a checkpointed step names the state it left (records.py).
        self._step_record(entry, taken, stale, filtered, snap.content_hash, settings, state)
        # Rollouts older than async_level are refused as stale from now on: their keys can go.
        await self.admitted.compact(fresh_floor(self.version, self.cfg.run.async_level))
        self._forget_old()
        return snap

    def _checkpoint_due(self) -> bool:
        """After a step that trained: ``rl.checkpoint_every`` versions since the last checkpoint, or the
        run's audit coverage rule (``run.audit_checkpoint_every`` trained steps since the last state
        published, whatever the local setting: every node checks it, ``roles/common/audits.py``)."""
        every = self.cfg.run.audit_every
        return (self.version - self._ckpt_version >= self.rl.checkpoint_every
                or (every > 0 and self.step - self._state_step >= every))

    def _step_record(self, entry: JournalEntry, taken: list[Accepted], stale: list[Accepted],
                     filtered: FilteredGroups[Sample], new_hash: str, settings: StepSettings,
                     state: StateFiles | None = None) -> None:
        """Publish the signed record of the step just taken (``records.py``), with the state checkpointed
        after it if any; the version and step are already the new ones when it trained. It names the
        accepted batches dropped since the last record (journaled with the step, so a replay makes the
        same record)."""
        assert self.records is not None, "start() makes the records before any step"
        trained = bool(filtered.useful)
        base = (self.version - 1 if trained else self.version, self._head_hash)
        self.records.emit(build_record(run_id=self.run_id, seq=entry.seq, step=self.step, base=base,
                                       new=(self.version, new_hash), taken=taken, stale=stale,
                                       useful=filtered.useful, no_signal=filtered.cause,
                                       settings=settings, dropped=entry.dropped), state)
        self._head_hash = new_hash

    def _attempted(self, filtered: FilteredGroups[Sample], samples: list[Sample]) -> None:
        self.no_signal.attempted(filtered, samples, self.rescorer.shown, self.rescorer.answer_mode)

    def _forget_old(self) -> None:
        """Bound what grows with the run: decisions on stale batches, and consumed IDs past the window."""
        self.admission.forget_below(self.version)
        floor = self.version - CONSUMED_KEEP_VERSIONS
        if any(v < floor for v in self.consumed.values()):
            self.consumed = {c: v for c, v in self.consumed.items() if v >= floor}

    async def _checkpoint(self, publish: bool = False) -> StateFiles | None:
        """Commit the model, optimizer and consumed set; then drop what the checkpoint now holds: the inbox
        copies of the batches consumed since the last one and the journal entries up to now. ``publish``:
        also prepare the state's files for the step record (the checkpoint of a step's version)."""
        covered = self.journal.seq
        saved = TrainerState(version=self.version, consumed=frozenset(self.consumed), step=self.step,
                             extra={"journal_seq": covered, "lr_scale": self.lr_scale})

        def commit() -> StateFiles | None:
            path = save_checkpoint(self.dir / "checkpoints", self.model, self.opt, saved)
            if not publish or self.opt is None or self.records is None:
                return None
            return self.records.state_files(path, self.version, self.opt)

        state = await asyncio.to_thread(commit)
        self._ckpt_version = self.version
        for cid in self._undropped:
            self.inbox.drop(cid)
        self._undropped = set()
        await asyncio.to_thread(self.journal.trim, covered)
        return state

    def _record(self, stats: StepStats | None, samples: list[Sample], filtered: FilteredGroups[Sample],
                taken: list[Accepted], stale: list[Accepted], seq: int) -> None:
        rewards = [s.reward for s in samples]
        pass_rate = sum(1 for r in rewards if r >= 1.0) / max(len(rewards), 1)
        reward_mean = sum(rewards) / max(len(rewards), 1)
        # Staleness: how many versions behind the weights being updated each sample's policy was.
        base = self.version - (1 if stats is not None else 0)
        stale_v = [base - s.policy_version for s in samples]
        total = self.idle_s + self.busy_s
        counts = self.intake.counts
        batches = sorted([a.cid for a in taken] + [a.cid for a in stale])
        # Each taken batch's hops (wall-clock seconds): notice heard, prefetched, verdict heard, admitted.
        hops: dict[str, dict[str, str | float]] = {
            a.cid: {"worker": a.worker, **(self.intake.hops.get(a.cid) or {})} for a in taken}
        line: StepLine = {
                "step": self.step, "version": self.version, "trained": stats is not None, "time": time.time(),
                "seq": seq, "pass_rate": pass_rate, "reward_mean": reward_mean, "samples": len(samples),
                "groups": filtered.total, "groups_used": len(filtered.useful),
                "filtered_fraction": filtered.dropped / filtered.total if filtered.total else 1.0,
                "no_signal": filtered.cause,
                "loss": stats.loss if stats else 0.0, "grad_norm": stats.grad_norm if stats else 0.0,
                "clipped_frac": stats.clipped_frac if stats else 0.0,
                "kl_sampler": stats.kl_sampler if stats else 0.0,
                "ratio_mean": stats.ratio_mean if stats else 1.0,
                "ratio_max": stats.ratio_max if stats else 1.0,
                "lr": stats.lr if stats else 0.0, "entropy": stats.neg_logp if stats else 0.0,
                "loss_kind": self.rl.loss,
                "staleness_mean": sum(stale_v) / max(len(stale_v), 1),
                "staleness_max": max(stale_v, default=0),
                "batch_ages": sorted(base - a.version for a in taken),
                "accepted": counts["accepted_rollouts"], "rejected": counts["rejected_rollouts"],
                "stale": counts["stale_rollouts"],
                "idle_fraction": self.idle_s / total if total else 0.0,
                "batches": batches, "hops": hops, "published": dict(self.publication.published)}
        if stats is not None and self._timing is not None:
            line = {**line, **self._timing}
        self.last = line
        self.metrics.write(line, seq)
        self.mirrors.step(line)  # queued for the mirrors' thread: the loop never waits for W&B
        if stats is not None:
            diag = StepDiagnostics(kl_sampler=stats.kl_sampler, clipped_frac=stats.clipped_frac,
                                   ratio_mean=stats.ratio_mean, ratio_max=stats.ratio_max,
                                   grad_norm=stats.grad_norm, lr=stats.lr, entropy=stats.neg_logp,
                                   staleness_max=max(stale_v, default=0))
            self.rt.board.train_step(self.step, reward_mean=reward_mean, pass_rate=pass_rate,
                                     diagnostics=diag, step_warning=self.step_check.checked(stats))
        log.info("step %d -> v%d: pass %.3f reward %.3f (%d samples, %d/%d groups, staleness %.2f)%s",
                 self.step, self.version, pass_rate, reward_mean, len(samples), len(filtered.useful),
                 filtered.total, line["staleness_mean"],
                 f": no learnable group ({filtered.cause}), nothing trained" if filtered.cause else "")
