"""Validator role: verify workers' rollout batches, publish signed verdicts, ban repeat offenders.

For each notice (already signature-checked and run-checked in the gossip validator; banned senders are
dropped there too):

1. staleness: a batch generated with a policy more than ``run.async_level`` versions behind the newest
   announced one is refused as ``stale`` (not held against the worker: the network may have been slow);
   one from a version this validator does not hold yet waits for it (bounded);
2. the blob is fetched (its announced size is checked before any chunk moves), decoded strictly, and
   every record must be the notice signer's, of this run and of the notice's version, in whole groups,
   with the sampling seeds and rollout IDs the run derives (``proofs/sampling.batch_seeds``);
3. the records go through :class:`~intellect_node.node.engines.verifier.Verifier` with the run's
   expectations (version, checkpoint hash, dtype, sampling settings): signature, sanity (lengths, token
   IDs in the vocabulary, termination, the prompt of the named problem), the reward recomputed from the
   task, TOPLOC, logprob and seeded-sampler checks. ``rl.verify_fraction`` < 1 runs the tensor checks on
   a random subset of groups; the cheap checks always run on everything;
4. the verdict is published; a rejected batch counts against the worker, and at ``rl.ban_after``
   rejections the worker is banned (its connections closed, its later gossip dropped) and the verdict
   says so, so the trainer and the other nodes ban it too.

The validator keeps an engine for each of the last ``async_level + 1`` policy versions so it can check
rollouts from any version the trainer would still accept.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

from intellect_node.errors import IntellectNodeError, ProtocolError
from intellect_node.node.engines.torch_engine import TorchEngine
from intellect_node.node.engines.verifier import Expectations, Verdict, Verifier, seed_violation
from intellect_node.node.roles.common import HintedFetcher, follow_trainer_policy, require_trainer, base_model, blob_service, \
    group_slices, loaded_from_checkpoint, model_dir, run_task
from intellect_node.proofs.thresholds import load_thresholds
from intellect_node.trainer.filtering import FilteredTask
from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement, announcement_validator
from intellect_node.protocol.rl import MAX_DETAIL_LEN, NOTICE_KIND, VERDICT_KIND, BatchVerdict, \
    RolloutNotice, notice_validator, seal_verdict
from intellect_node.protocol.rollout import MAX_BATCH_SIZE, decode_batch
from intellect_node.protocol.topics import topic

log = logging.getLogger(__name__)

WAIT_FOR_POLICY_S = 30.0
"""How long a batch from a version not held yet waits for that version's announcement and fetch."""
FETCH_TIMEOUT_S = 60.0


class Validator:
    name = "validator"

    def __init__(self, runtime: Any) -> None:
        cfg = runtime.config
        require_trainer(cfg, "validator")
        self.rt = runtime
        self.cfg = cfg
        self.rl = cfg.rl
        self.run_id = cfg.run.run_id
        self.async_level = cfg.run.async_level
        self.task = run_task(cfg)  # also registers a JSONL task so problem IDs resolve
        self.base = base_model(cfg)
        self.thresholds = load_thresholds(model_dir(cfg), cfg.run.dtype)
        self.dir = Path(runtime.data_dir) / "validator"
        self.engines: OrderedDict[int, tuple[str, TorchEngine]] = OrderedDict()
        self.latest_announced = -1
        self._latest: PolicyAnnouncement | None = None
        self._new_policy = asyncio.Event()
        self._policy_changed = asyncio.Condition()
        self._queue: asyncio.Queue[tuple[RolloutNotice, str]] = asyncio.Queue(maxsize=1024)
        self._tasks: list[asyncio.Task[None]] = []
        self.rejections: dict[str, int] = {}
        self.reasons: dict[str, list[str]] = {}
        self.counts = {"accepted": 0, "rejected": 0, "stale": 0, "banned": 0}
        self.rng = random.Random()

    @classmethod
    def for_runtime(cls, runtime: Any) -> "Validator":
        return cls(runtime)

    async def start(self) -> None:
        self.blobs = blob_service(self.rt)
        self.fetcher = HintedFetcher(self.blobs, self.rt.swarm)
        self.follower = follow_trainer_policy(self.rt, self.fetcher, self.dir / "policy")
        if self.follower.checkpoint is not None and self.follower.version is not None:
            await self._add_engine(self.follower.version, self.follower.checkpoint)
        sw = self.rt.swarm
        sw.subscribe(topic(self.run_id, POLICY_KIND),
                     announcement_validator(self.run_id, self.cfg.run.trainer_peer_id), self._on_announcement)
        sw.subscribe(topic(self.run_id, NOTICE_KIND), notice_validator(self.run_id), self._on_notice)
        self._tasks = [asyncio.create_task(self._sync_loop(), name="validator-policy"),
                       asyncio.create_task(self._loop(), name="validator-loop")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "fetcher"):
            self.fetcher.close()

    def status(self) -> dict[str, Any]:
        return {"versions_held": list(self.engines), "queue": self._queue.qsize(), **self.counts,
                "rejections_by_worker": dict(self.rejections), "reasons_by_worker": dict(self.reasons)}

    # -- policy ----------------------------------------------------------------------------------

    def _on_announcement(self, ann: PolicyAnnouncement, origin: str) -> None:
        if ann.version > self.latest_announced:
            self.latest_announced = ann.version
            self._latest = ann
            self._new_policy.set()

    async def _sync_loop(self) -> None:
        while True:
            await self._new_policy.wait()
            self._new_policy.clear()
            ann = self._latest
            if ann is None or ann.version in self.engines:
                continue
            try:
                res = await self.follower.obtain(ann)
            except IntellectNodeError as exc:
                log.warning("could not obtain policy v%d: %s", ann.version, exc)
                await asyncio.sleep(0.5)
                self._new_policy.set()
                continue
            await self._add_engine(res.version, res.checkpoint)

    async def _add_engine(self, version: int, ckpt: Any) -> None:
        loaded = await asyncio.to_thread(loaded_from_checkpoint, self.base, ckpt)
        engine = await asyncio.to_thread(TorchEngine, loaded)
        async with self._policy_changed:
            self.engines[version] = (ckpt.content_hash, engine)
            while len(self.engines) > self.async_level + 1:
                self.engines.popitem(last=False)
            self.latest_announced = max(self.latest_announced, version)
            self._policy_changed.notify_all()

    # -- verification ----------------------------------------------------------------------------

    def _on_notice(self, msg: tuple[RolloutNotice, str], origin: str) -> None:
        notice, worker = msg
        if self.rt.swarm.is_banned(worker):
            return
        try:
            self._queue.put_nowait((notice, worker))
        except asyncio.QueueFull:
            log.warning("verification queue full; dropping a notice from %s", worker)

    async def _loop(self) -> None:
        while True:
            notice, worker = await self._queue.get()
            if self.rt.swarm.is_banned(worker):
                continue
            try:
                verdict = await self.check(notice, worker)
            except asyncio.CancelledError:
                raise
            except IntellectNodeError as exc:  # could not fetch: no verdict, the worker is not blamed
                log.warning("batch %s from %s not checked: %s", notice.batch_cid, worker, exc)
                continue
            await self.publish(verdict, worker)

    async def _engine_for(self, version: int) -> tuple[str, TorchEngine] | None:
        async with self._policy_changed:
            try:
                await asyncio.wait_for(self._policy_changed.wait_for(
                    lambda: version in self.engines or min(self.engines, default=-1) > version),
                    WAIT_FOR_POLICY_S)
            except asyncio.TimeoutError:
                return None
            return self.engines.get(version)

    def _verdict(self, notice: RolloutNotice, worker: str, n_ok: int, n_bad: int, reason: str = "",
                 detail: str = "") -> BatchVerdict:
        return BatchVerdict(run_id=self.run_id, batch_cid=notice.batch_cid, worker=worker,
                            policy_version=notice.policy_version, accepted=n_bad == 0 and n_ok > 0,
                            n_accepted=n_ok, n_rejected=n_bad, reason=reason[:64], detail=detail[:MAX_DETAIL_LEN])

    async def check(self, notice: RolloutNotice, worker: str) -> BatchVerdict:
        n = notice.n_rollouts
        if notice.policy_version < self.latest_announced - self.async_level:
            return self._verdict(notice, worker, 0, n, "stale", f"version {notice.policy_version}, newest "
                                 f"{self.latest_announced}, async_level {self.async_level}")
        held = await self._engine_for(notice.policy_version)
        if held is None:
            return self._verdict(notice, worker, 0, n, "stale" if notice.policy_version < self.latest_announced
                                 else "policy_version", f"no policy v{notice.policy_version} to check against")
        ckpt_hash, engine = held
        if notice.batch_bytes > MAX_BATCH_SIZE:
            return self._verdict(notice, worker, 0, n, "malformed", "batch too large")
        data = await self.fetcher.fetch(notice.batch_cid, holders=[worker], max_size=MAX_BATCH_SIZE,
                                        size=notice.batch_bytes, timeout=FETCH_TIMEOUT_S)
        try:
            batch = await asyncio.to_thread(decode_batch, data)
        except ProtocolError as exc:
            return self._verdict(notice, worker, 0, n, "malformed", str(exc))
        recs = batch.rollouts
        if batch.run_id != self.run_id or batch.policy_version != notice.policy_version or len(recs) != n:
            return self._verdict(notice, worker, 0, n, "malformed", "batch does not match its notice")
        if any(r.worker != worker for r in recs):
            return self._verdict(notice, worker, 0, n, "bad_signature", "records of another worker")
        groups = group_slices(recs, self.rl.group_size)
        if isinstance(groups, str):
            return self._verdict(notice, worker, 0, n, "groups", groups)
        if isinstance(self.task, FilteredTask):
            outside = next((r.problem_id for r in recs if r.problem_id not in self.task), None)
            if outside is not None:
                return self._verdict(notice, worker, 0, n, "unknown_task",
                                     f"{outside} is not among the run's offline-filtered problems")
        bad_seed = seed_violation(recs, self.run_id, notice.policy_version, worker)
        if bad_seed:
            return self._verdict(notice, worker, 0, n, "seed", bad_seed)
        expect = Expectations(run_id=self.run_id, policy_version=notice.policy_version, checkpoint_cid=ckpt_hash,
                              temperature=self.rl.temperature, top_p=1.0, max_new_tokens=self.rl.max_new_tokens)
        verifier = Verifier(engine, self.thresholds, expect)
        full = list(range(len(recs)))
        if self.rl.verify_fraction < 1.0:
            k = max(1, round(len(groups) * self.rl.verify_fraction))
            full = sorted(i for g in self.rng.sample(groups, k) for i in range(g.start, g.stop))
        verdicts = await asyncio.to_thread(self._verify, verifier, recs, set(full))
        bad = [v for v in verdicts if not v.accepted]
        for v in verdicts:
            self.rt.board.proof_checked(v.accepted, reason=v.reason or "")
        if bad:
            return self._verdict(notice, worker, n - len(bad), len(bad), bad[0].reason or "rejected", bad[0].detail)
        return self._verdict(notice, worker, n, 0)

    @staticmethod
    def _verify(verifier: Verifier, recs: list[Any], full: set[int]) -> list[Verdict]:
        if len(full) == len(recs):
            return verifier.verify(recs)
        # Cheap checks (signature, sanity, reward) on all; tensor checks on the sampled groups only.
        out = verifier.verify([recs[i] for i in sorted(full)])
        for i, r in enumerate(recs):
            if i not in full:
                v = verifier._cheap(r)
                out.append(v if v is not None else Verdict(r.rollout_id, r.worker, True))
        return out

    async def publish(self, verdict: BatchVerdict, worker: str) -> None:
        if verdict.accepted:
            self.counts["accepted"] += 1
        elif verdict.reason == "stale":
            self.counts["stale"] += 1
        else:
            self.counts["rejected"] += 1
            self.rejections[worker] = self.rejections.get(worker, 0) + 1
            self.reasons.setdefault(worker, []).append(verdict.reason)
            self.rt.swarm.peerbook.record_rejection(worker, f"batch {verdict.batch_cid}: {verdict.reason}")
            if self.rejections[worker] >= self.rl.ban_after and not self.rt.swarm.is_banned(worker):
                import msgspec

                verdict = msgspec.structs.replace(verdict, ban=True)
                await self.rt.swarm.ban(worker, f"{self.rejections[worker]} rejected batches, last: "
                                                f"{verdict.reason}")
                self.counts["banned"] += 1
        self.rt.board.verdict(verdict.accepted, verdict.n_accepted + verdict.n_rejected, reason=verdict.reason,
                              detail=verdict.detail, peer=worker)
        log.info("batch %s from %s v%d: %s%s", verdict.batch_cid[-8:], worker[-6:], verdict.policy_version,
                 "accepted" if verdict.accepted else f"rejected ({verdict.reason}: {verdict.detail[:80]})",
                 " -> banned" if verdict.ban else "")
        await self.rt.swarm.publish(topic(self.run_id, VERDICT_KIND), seal_verdict(self.rt.swarm.key, verdict))
