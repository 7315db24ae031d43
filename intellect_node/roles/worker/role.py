"""Worker role: follow the trainer's policy, generate rollouts with proofs, publish them.

Loop: wait until a policy is held -> take the next window of this worker's assignment at that version
(``problems_per_batch`` problems of the run's task, each ``group_size`` times) -> generate with the engine
(seeded sampler, TOPLOC proofs, rewards from the task, every record signed) -> record the batch in the
ledger -> put the encoded
:class:`~intellect_node.protocol.rollout.RolloutBatch` in the blob store -> gossip a signed
:class:`~intellect_node.protocol.rl.RolloutNotice`. Policy announcements are accepted only from the run's
configured trainer (checked in the gossip validator); a new version is fetched through the swarm
(delta or full, hash-checked; ``roles/common/follow.py``) while generation continues on the old one.

A worker submits at most ``rl.batches_per_version`` batches per policy version, then waits for the next
announcement: older work would only be refused as stale once the trainer moves on. With ``rl.work_ahead``
= k it starts with k versions' worth more (each new version then adds one version's worth, up to that
cap), so its batches for the trainer's next step are made and verified while the trainer runs the current
one, one version stale, and it still makes no more rollouts than the trainer takes. A step that consumed
its batches without training (the trainer's step record says so) and a batch a validator could not judge
give their credit back at once; no timer paces a healthy run (``pacing.py``).

Problems are assigned, not chosen (``envs/assignment.py``): the k-th batch a worker makes at policy
version v holds exactly window k of its assignment at v, which every validator and the trainer recompute
(a batch that is not: ``not_assigned``). The windows of a version are made in order, 0, 1, 2, ...; a
window skipped (a later one submitted) shows in their status as an assignment never submitted. The next
window at the current version is kept in ``worker/used.json`` (written before generating, with the
window's problems) so a restarted worker does not make a window twice: its sampling seeds derive from
(run, version, worker, problem, sample index), so it would repeat the same rollouts, refused as
``duplicate``. In a closed run (``run.worker_allowlist``) a worker not on the list refuses to start.

The engine is the ``[inference]`` section's (``roles/common/engines.py``): the torch engine gets a fresh
engine per policy version (weights in memory, cheap); vLLM is started once from the model folder and
each version's weights are swapped into it, never during a batch (``_engine_lock``). A worker whose
engine@device the run does not list in ``run.rollout_engines`` refuses to start.

With ``run.require_audits`` on, a worker stops working for a trainer that failed an audit
(``roles/common/audits.py``): it generates and submits nothing more (a batch made meanwhile is withheld,
``withheld`` in its status), adopts no newer policy, and its status says why (``audit_refusal``, and the
node reads ``degraded``).

The record-building step is :meth:`Worker.make_records`; tests subclass it to play a cheating worker.

The first completion of each group it generates, with its reward and the answer the run's extraction
finds in it, goes to the status board (``training.completions``; ``roles/common/completions.py``).

``worker/hops.jsonl`` (diagnostics, not fsynced) timestamps the worker's side of the learning loop for
``bench/learning.py``: each new version announced (heard) and loaded (with where the follower's time went:
fetch, apply, persist, engine), and each batch submitted; past :data:`HOPS_MAX_BYTES` it is rotated to
``hops.jsonl.1`` (one old file kept), as the validator's is (``fsutil.JsonlAppender``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from intellect_node.envs.tasks import Problem
from intellect_node.errors import IntellectNodeError
from intellect_node.fsutil import append_jsonl, atomic_write_bytes, atomic_write_text
from intellect_node.inference import InferenceEngine, SamplingConfig, make_engine
from intellect_node.inference.base import WeightSwapEngine
from intellect_node.inference.rollouts import generate_rollouts
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import PolicyAnnouncement
from intellect_node.protocol.rl import (
    NOTICE_KIND,
    VERDICT_KIND,
    BatchVerdict,
    RolloutNotice,
    seal_notice,
    verdict_validator,
)
from intellect_node.protocol.rollout import RolloutBatch, RolloutRecord, encode_batch
from intellect_node.protocol.steps import STEP_KIND, StepRecord, record_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.audits import audit_gate
from intellect_node.roles.common.completions import completion
from intellect_node.roles.common.engines import engine_choice, require_rollout_engine
from intellect_node.roles.common.fetch import ANNOUNCE_MIN_CHUNKS, HintedFetcher
from intellect_node.roles.common.follow import TrainerPolicy
from intellect_node.roles.common.models import base_model, loaded_from_checkpoint
from intellect_node.roles.common.receipts import Receipts
from intellect_node.roles.common.run import require_allowed, require_trainer
from intellect_node.roles.common.seams import RoleTasks, Runtime
from intellect_node.roles.common.seen import BoundedMap
from intellect_node.roles.common.services import blob_service, ledger_of
from intellect_node.roles.common.tasks import run_assignments, run_task
from intellect_node.roles.worker.pacing import Pacing

log = logging.getLogger(__name__)

USED_FILE = "used.json"
HOPS_FILE = "hops.jsonl"
HOPS_MAX_BYTES = 16 << 20
"""``worker/hops.jsonl`` is rotated past this size (to ``hops.jsonl.1``, one old file kept)."""


class Worker:
    name = "worker"

    def __init__(self, runtime: Runtime) -> None:
        cfg = runtime.config
        require_trainer(cfg, "worker")
        require_allowed(cfg, runtime.swarm.peer_id)
        self.choice = engine_choice(cfg, "worker")
        require_rollout_engine(cfg, self.choice)
        self.rt = runtime
        self.cfg = cfg
        self.rl = cfg.rl
        self.run_id = cfg.run.run_id
        self.task = run_task(cfg)
        self.assignments = run_assignments(cfg, self.task)
        self.base = base_model(cfg)
        self.tokenizer = self.base.tokenizer
        self.sampling = SamplingConfig(temperature=self.rl.temperature, top_p=1.0,
                                       max_new_tokens=self.rl.max_new_tokens)
        self.dir = Path(runtime.data_dir) / "worker"
        self.engine: InferenceEngine | None = None
        self._engine_lock = asyncio.Lock()  # a batch's generation, or a weight swap into vLLM
        self.version = -1
        self.checkpoint_hash = ""
        self.tasks = RoleTasks(runtime, "worker")
        self.batches = 0
        self.verdicts: dict[str, int] = {"accepted": 0, "rejected": 0, "stale": 0}
        self._heard: BoundedMap[int, str] = BoundedMap(64)  # version -> announced hash
        self.fetcher: HintedFetcher | None = None  # made by start(), closed by close()
        self.receipts: Receipts | None = None  # start() makes it when the node keeps a ledger
        self.audit_refusal = audit_gate(runtime)  # "" while the trainer may be worked for
        self.withheld = 0  # batches made, then not submitted: the trainer failed an audit meanwhile
        self.pacing = Pacing(self.rl.batches_per_version, self.rl.work_ahead, async_level=cfg.run.async_level)

    @classmethod
    def for_runtime(cls, runtime: Runtime) -> "Worker":
        return cls(runtime)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.blobs = blob_service(self.rt)
        self.fetcher = fetcher = HintedFetcher(self.blobs, self.rt.swarm)
        self.ledger = ledger_of(self.rt)
        trainer = require_trainer(self.cfg, "worker")
        if self.ledger is not None:  # the trainer's step records: this worker's receipts
            self.receipts = Receipts(self.ledger, run_id=self.run_id, trainer=trainer,
                                     async_level=self.cfg.run.async_level)
        # the step records also pace this worker (``pacing.py``): a step that trained nothing gives back
        self.rt.swarm.subscribe(topic(self.run_id, STEP_KIND), record_validator(self.run_id, trainer),
                                self._on_record)
        self.policy = TrainerPolicy(self.rt, fetcher, self.dir / "policy", self.tasks, self._load,
                                    on_announcement=self._on_announcement)
        await self.policy.start()
        trusted = frozenset(self.cfg.run.validator_peer_ids) or None
        self.rt.swarm.subscribe(topic(self.run_id, VERDICT_KIND), verdict_validator(self.run_id, trusted),
                                self._on_verdict)
        self.tasks.loop("worker-loop", self._loop)

    async def close(self) -> None:
        await self.tasks.close()
        if self.fetcher is not None:
            self.fetcher.close()

    def status(self) -> dict[str, object]:
        return {"policy_version": self.version, "batches": self.batches, **self.verdicts,
                "step_records": self.receipts.status() if self.receipts is not None else {},
                "audit_refusal": self.audit_refusal(), "withheld": self.withheld,
                "pacing": self.pacing.status(),
                "refused_announcements": self.policy.refused_announcements if hasattr(self, "policy") else 0}

    # -- policy ----------------------------------------------------------------------------------

    def _hop(self, event: str, **fields: object) -> None:
        """One line of ``worker/hops.jsonl`` (see the module docstring)."""
        append_jsonl(self.dir / HOPS_FILE, {"event": event, "t": time.time(), **fields}, fsync=False,
                     max_bytes=HOPS_MAX_BYTES)

    def _on_announcement(self, ann: PolicyAnnouncement) -> None:
        """A new version announced, or a version announced again with other content (which a trainer
        must never do: the hops log is where a test would see it)."""
        if self._heard.get(ann.version) != ann.checkpoint_hash:
            self._heard.put(ann.version, ann.checkpoint_hash)
            self._hop("announced", version=ann.version, hash=ann.checkpoint_hash)

    async def _load(self, version: int, ckpt: PolicyWeights) -> None:
        """A new policy version (``roles/common/follow.py``): generation moves to it at its next batch."""
        t0 = time.monotonic()
        loaded = await asyncio.to_thread(loaded_from_checkpoint, self.base, ckpt)
        if self.choice.name == "torch":
            engine = await asyncio.to_thread(make_engine, loaded, "torch", device=self.choice.device)
            async with self._engine_lock:
                if self.policy.refused_after_load(version, holding=self.version >= 0):
                    return
                self.engine = engine
                self.version, self.checkpoint_hash = version, ckpt.content_hash
        else:
            async with self._engine_lock:  # vLLM's weights change in place: not under a running batch
                if self.engine is None:
                    self.engine = await asyncio.to_thread(
                        make_engine, self.base.path, self.choice.name, dtype=self.base.dtype,
                        device=self.choice.device, vllm=self.choice.vllm)
                if self.policy.refused_after_load(version, holding=self.version >= 0):
                    return
                swap = self.engine
                if not isinstance(swap, WeightSwapEngine):  # make_engine gives vLLM's, which swaps
                    raise TypeError(f"the {self.choice.name} engine cannot take new weights in place")
                await asyncio.to_thread(swap.load_weights, loaded.state)
                self.version, self.checkpoint_hash = version, ckpt.content_hash
        self.rt.board.set_policy(local=version)
        last = self.policy.follower.last
        self._hop("loaded", version=version, hash=ckpt.content_hash, engine_s=time.monotonic() - t0,
                  **({"path": last.path, **last.timings} if last is not None and last.version == version
                     else {}))

    # -- generation ------------------------------------------------------------------------------

    def assigned(self, version: int, window: int) -> list[Problem]:
        """Window ``window`` of this worker's assignment at ``version`` (``envs/assignment.py``), each
        problem ``group_size`` times."""
        probs = self.assignments.problems(self.rt.swarm.peer_id, version, window)
        return [p for p in probs for _ in range(self.rl.group_size)]

    def make_records(self, engine: InferenceEngine, problems: list[Problem], version: int,
                     checkpoint: str) -> list[RolloutRecord]:
        """Generate and sign one batch's records (runs in a worker thread)."""
        return generate_rollouts(engine, self.tokenizer, problems, key=self.rt.swarm.key, run_id=self.run_id,
                                 policy_version=version, checkpoint=checkpoint, sampling=self.sampling)

    def _show(self, problems: list[Problem], records: list[RolloutRecord]) -> None:
        """The first completion of each group to the status board (worker thread: a decode each)."""
        g = self.rl.group_size
        self.rt.board.completions(
            completion(p, self.tokenizer.decode(list(r.completion_tokens)), r.reward,
                       policy_version=r.policy_version)
            for p, r in list(zip(problems, records))[::g])

    def _load_used(self) -> tuple[int, int]:
        """The version this worker last generated for and its next window there (``worker/used.json``)."""
        path = self.dir / USED_FILE
        try:
            doc = json.loads(path.read_text())
            return int(doc["version"]), int(doc["next"])
        except FileNotFoundError:
            return -1, 0
        except (OSError, ValueError, KeyError, TypeError) as exc:  # ours; at worst a repeat is refused
            log.warning("ignoring unreadable %s: %s", path, exc)
            return -1, 0

    async def _loop(self) -> None:
        pacing = self.pacing
        version_seen, window = self._load_used()  # the next window of this worker's assignment there
        if version_seen >= 0:
            pacing.on_version(version_seen)
        while True:
            if self.audit_refusal():  # run.require_audits: nothing more for this trainer
                await asyncio.sleep(0.5)
                continue
            if self.engine is None:
                await asyncio.sleep(0.05)
                continue
            if self.version != version_seen:
                pacing.on_version(self.version)
                version_seen = self.version
                window = 0
            if not pacing.may_make():
                await asyncio.sleep(0.05)
                continue
            if window >= self.assignments.layout.windows:  # every window of this version made: wait
                pacing.exhausted()
                continue
            engine, version, ckpt_hash = self.engine, self.version, self.checkpoint_hash
            t0 = time.monotonic()
            # a reasoning-gym task generates problems as they are looked up (some datasets take a second
            # an item): off the event loop
            problems = await asyncio.to_thread(self.assigned, version, window)
            window += 1
            # Persisted before generating: a restart at this version must not make this window again.
            made = {"version": version, "next": window,
                    "problems": [p.problem_id for p in problems[::self.rl.group_size]]}
            await asyncio.to_thread(atomic_write_text, self.dir / USED_FILE, json.dumps(made))
            async with self._engine_lock:
                if self.version != version:  # a new policy landed meanwhile: generate for it instead
                    continue
                records = await asyncio.to_thread(self.make_records, engine, problems, version, ckpt_hash)
            n_tokens = sum(len(r.completion_tokens) for r in records)
            self.rt.board.rollouts_generated(len(records), tokens=n_tokens)
            await asyncio.to_thread(self._show, problems, records)
            if self.audit_refusal():
                self.withheld += 1
                log.warning("batch of v%d withheld: %s", version, self.audit_refusal())
                continue
            try:
                await self.submit(records, version, n_tokens)
            except IntellectNodeError as exc:
                log.warning("could not submit a batch: %s", exc)
                await asyncio.sleep(0.5)
                continue
            log.debug("batch of %d rollouts at v%d in %.2fs", len(records), version, time.monotonic() - t0)

    async def submit(self, records: list[RolloutRecord], version: int, n_tokens: int) -> str:
        data = encode_batch(RolloutBatch(run_id=self.run_id, policy_version=version, rollouts=records))
        path = self.dir / "outbox" / f"{records[0].rollout_id}.batch"
        await asyncio.to_thread(atomic_write_bytes, path, data)
        cid, _ = await self.blobs.put_file(path, name=f"{self.run_id}-rollouts-v{version}",
                                           announce_min_chunks=ANNOUNCE_MIN_CHUNKS)
        self.pacing.submitted(cid, version)
        path.unlink(missing_ok=True)  # the blob store holds it now
        if self.ledger is not None:
            await asyncio.to_thread(self.ledger.record_submission, cid, run_id=self.run_id,
                                    policy_version=version, n_rollouts=len(records), n_tokens=n_tokens,
                                    cid=cid)
        notice = RolloutNotice(run_id=self.run_id, batch_cid=cid, policy_version=version,
                               n_rollouts=len(records), batch_bytes=len(data))
        await self.rt.swarm.publish(topic(self.run_id, NOTICE_KIND), seal_notice(self.rt.swarm.key, notice))
        self.batches += 1
        self._hop("submitted", cid=cid, version=version)
        self.rt.board.rollouts_submitted(len(records))
        self.rt.board.mark("first_batch_submitted")  # the join timeline (config/status.py); once only
        return cid

    async def _on_record(self, rec: StepRecord, origin: str) -> None:
        if self.receipts is not None:
            await self.receipts.on_record(rec, origin)
        if given := self.pacing.on_record(rec, self.rt.swarm.peer_id):
            log.debug("step record %d trained nothing (%s): %d batch(es) more", rec.seq, rec.no_signal, given)

    async def _on_verdict(self, msg: tuple[BatchVerdict, str], origin: str) -> None:
        verdict, validator = msg
        if verdict.worker != self.rt.swarm.peer_id:
            return
        if self.ledger is not None and not await asyncio.to_thread(
                self.ledger.record_verdict, verdict.batch_cid, validator=validator, run_id=self.run_id,
                n_accepted=verdict.n_accepted, n_rejected=verdict.n_rejected, reason=verdict.reason,
                detail=verdict.detail):
            return  # this validator's word on this batch was taken before: a replay or a re-send
        if not verdict.accepted and self.pacing.on_refusal(verdict.batch_cid, verdict.reason):
            log.debug("batch %s not judged (%s): one batch more", verdict.batch_cid[:16], verdict.reason)
        kind = "accepted" if verdict.accepted else "stale" if verdict.reason == "stale" else "rejected"
        self.verdicts[kind] += 1
        n = verdict.n_accepted + verdict.n_rejected
        self.rt.board.verdict(verdict.accepted, n, reason=verdict.reason, detail=verdict.detail,
                              peer=validator)
        if verdict.accepted:
            self.rt.board.mark("first_batch_accepted")
