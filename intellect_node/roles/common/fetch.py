"""What the trainer, worker and validator roles share: the run's task, engines built from policy
checkpoints, reading blobs, and turning verified rollout records into training samples.

Each role is a node service (``start``/``close``/``status``, see ``node/runtime.py``). Its loop runs as
an asyncio task; every torch call goes to a worker thread (``asyncio.to_thread``) so the event loop
keeps serving HTTP and gossip while a model runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from intellect_node.blobs.service import BlobService
from intellect_node.config import NodeConfig
from intellect_node.config.ledger import Ledger, LedgerService
from intellect_node.config.status import clean_text
from intellect_node.envs.tasks import Problem, Task
from intellect_node.errors import ConfigError, IntegrityError, TransportError
from intellect_node.models.loader import LoadedModel, load_model, resolve_model_dir, torch_dtype
from intellect_node.p2p.swarm import Swarm
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.blob import Manifest
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.roles.seams import Runtime
from intellect_node.trainer.step import Sample

if TYPE_CHECKING:
    from intellect_node.blobs.fetch import FetchStats, Provider

log = logging.getLogger(__name__)

MAX_POLICY_BYTES = 4 << 30
"""Largest policy checkpoint a worker or validator accepts (the announced size is checked first)."""

ANNOUNCE_MIN_CHUNKS = 4
"""A blob a role fetched is announced in the DHT from this many chunks (12 MiB at the default 3 MiB
chunks): large enough that its followers gain from fetching from each other (see ``HintedFetcher``)."""


def run_task(cfg: NodeConfig, *, filtered: bool = True) -> Task:
    """The run's task: the reward environment (``rl.env``), the JSONL file, or ``rl.task``, under the
    run's extraction and system-prompt settings and registered so its problem IDs resolve
    (``envs.environment.build_task``); narrowed to the offline filter's band when
    ``rl.solve_rates_file`` is set and ``filtered`` (``tasks solve-rates`` measures the whole task)."""
    from intellect_node.envs.environment import build_task

    rl = cfg.rl
    task: Task = build_task(task=rl.task, tasks_file=rl.tasks_file or None, env=rl.env or None,
                            env_args=dict(rl.env_args), answer_format=rl.answer_format, think=rl.think,
                            max_completion_chars=rl.max_completion_chars, system_prompt=rl.system_prompt,
                            reward_timeout_s=rl.reward_timeout_s)
    if filtered and cfg.rl.solve_rates_file:
        from intellect_node.envs.filtering import filter_by_rates_file

        task = filter_by_rates_file(task, cfg.rl.solve_rates_file, cfg.rl.solve_rate_band)
    return task


def model_dir(cfg: NodeConfig) -> Path:
    return resolve_model_dir(cfg.run.model or None)


def blob_service(runtime: Runtime) -> BlobService:
    for svc in runtime.services:
        if isinstance(svc, BlobService):
            return svc
    raise ConfigError("the RL roles need the blob service; add it before the role", field="services")


def ledger_of(runtime: Runtime) -> Ledger | None:
    """The node's ledger, or None when it runs without one (in-process tests)."""
    for svc in runtime.services:
        if isinstance(svc, LedgerService):
            return svc.ledger
    return None


def loaded_from_checkpoint(base: LoadedModel, ckpt: PolicyWeights) -> LoadedModel:
    """``base`` (config, tokenizer) with the weights of ``ckpt`` in the run's dtype."""
    dt = torch_dtype(base.dtype)
    state = {k: v.to(dtype=dt) if v.is_floating_point() else v for k, v in ckpt.to_state_dict().items()}
    missing = set(base.state) - set(state)
    if missing:
        raise IntegrityError(f"policy checkpoint lacks {sorted(missing)[:3]}")
    return replace(base, state=state)


def base_model(cfg: NodeConfig) -> LoadedModel:
    return load_model(cfg.run.model or None, dtype=cfg.run.dtype)


def require_trainer(cfg: NodeConfig, role: str) -> str:
    """The run's trainer peer ID, which a worker or validator cannot run without."""
    if not cfg.run.trainer_peer_id:
        raise ConfigError(f"a {role} needs the run's trainer: set run.trainer_peer_id (--trainer-peer-id)",
                          field="run.trainer_peer_id")
    return cfg.run.trainer_peer_id


def require_allowed(cfg: NodeConfig, peer_id: str) -> None:
    """A worker of a closed run (``run.worker_allowlist`` set) must be on the list: its batches would
    all be refused (``not_allowed``), so it is an operator error at start."""
    allow = cfg.run.worker_allowlist
    if allow and peer_id not in allow:
        raise ConfigError(f"this node ({peer_id}) is not on run.worker_allowlist ({len(allow)} peers); ask "
                          "the run's operator to add it, or join another run", field="run.worker_allowlist")


def read_blob(blobs: BlobService, cid: str) -> bytes:
    """The content of a complete blob in the local store (call after ``blobs.fetch``)."""
    store = blobs.store
    m = store.manifest(cid)
    if m is None or store.missing(cid):
        raise TransportError(f"blob {cid} is not complete")
    buf = bytearray()
    for c in m.chunks:
        buf += store.chunk_path(c).read_bytes()
    if len(buf) != m.total_size:
        raise IntegrityError(f"blob {cid}: chunks hold {len(buf)} of {m.total_size} bytes")
    return bytes(buf)


class HintedFetcher:
    """Fetches blobs whose holder is known (a notice's signer, a verdict's worker and validator).

    The node that announced a blob is its first provider, and its HTTP URL is in its heartbeats; asking
    it directly avoids depending on a DHT provider record that may not have reached the peers we know
    yet (it is made a moment before the notice). Every chunk is hash-checked by the fetcher as usual, so
    a hint can only cost time, never inject bytes.

    The first lookup of a blob answers with the hinted holders alone; every later one (a fetch looking
    again while it downloads from the holder alone, or after its providers failed) adds what the DHT
    knows. A fetched blob of ANNOUNCE_MIN_CHUNKS chunks or more is announced in the DHT as soon as its
    manifest is in, so the followers of a large policy find each other and take chunks from each other
    instead of all from the trainer (docs/training.md, "Blob fetching in the roles"). Smaller blobs (a
    policy delta, a rollout batch) are not: a provider record costs every node DHT traffic, and the
    holder serves them in a moment.
    """

    def __init__(self, blobs: BlobService, swarm: Swarm) -> None:
        from intellect_node.blobs.fetch import Fetcher
        from intellect_node.blobs.http import HttpChunkSource

        self.blobs = blobs
        self.swarm = swarm
        self._http = HttpChunkSource(addresses=blobs.addresses)  # a peer's URL leads only to that peer
        self._hints: dict[str, list[str]] = {}  # CID -> holders named by the fetches under way
        self._looked: set[str] = set()  # CIDs whose hinted-only first lookup was answered
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # CID -> (one fetch at a time, users)
        self._fetcher = Fetcher(blobs.store, [self._http], self._find, self_peer_id=swarm.peer_id,
                                penalise=swarm.peerbook.record_rejection, is_banned=swarm.peerbook.is_banned)

    async def _find(self, cid: str) -> Sequence[Provider]:
        from intellect_node.blobs.fetch import StaticProvider

        hinted: list[Provider] = [StaticProvider(p, url) for p in dict.fromkeys(self._hints.get(cid, []))
                                  if (url := self.swarm.peerbook.http_url(p))]
        if hinted and cid not in self._looked:
            self._looked.add(cid)
            return hinted
        named = {p.peer_id for p in hinted}
        return hinted + [p for p in await self.swarm.find_providers(cid) if p.peer_id not in named]

    def _seen(self, cid: str, check: Callable[[Manifest], None] | None) -> Callable[[Manifest], None]:
        """``check``, then announce a large blob (see the class docstring) once its manifest passed."""
        def on_manifest(m: Manifest) -> None:
            if check is not None:
                check(m)
            if len(m.chunks) >= ANNOUNCE_MIN_CHUNKS:
                self.blobs.announce(cid)
        return on_manifest

    async def fetch(self, cid: str, *, holders: Sequence[str], max_size: int, size: int | None = None,
                    timeout: float) -> bytes:
        """The content of blob ``cid``; refuses a manifest over ``max_size`` (or other than ``size``)."""
        def check(m: Manifest) -> None:
            if m.total_size > max_size or (size is not None and m.total_size != size):
                raise IntegrityError(f"blob {cid} holds {m.total_size} bytes (announced {size}, "
                                     f"limit {max_size})")

        from intellect_node.blobs.fetch import Budget

        async def fetch_one() -> None:
            lock, users = self._locks.get(cid, (asyncio.Lock(), 0))
            self._locks[cid] = (lock, users + 1)
            try:
                async with lock:
                    m = self.blobs.store.manifest(cid)
                    if m is not None:
                        check(m)
                    if m is None or self.blobs.store.missing(cid):
                        # The budget is checked before the manifest is stored (blobs/fetch.py, Budget).
                        await self._fetcher.fetch(cid, on_manifest=self._seen(cid, check),
                                                  budget=Budget(max_size=max_size, size=size))
            finally:
                lock, users = self._locks[cid]
                if users > 1:
                    self._locks[cid] = (lock, users - 1)
                else:
                    del self._locks[cid]

        # Concurrent fetches of one CID (two notices naming it) pool their hints and take turns.
        self._hints.setdefault(cid, []).extend(holders)
        try:
            await asyncio.wait_for(fetch_one(), timeout)
        finally:
            self._unhint(cid, holders)
        return await asyncio.to_thread(read_blob, self.blobs, cid)

    def _unhint(self, cid: str, holders: Sequence[str]) -> None:
        left = self._hints.get(cid, [])
        for h in holders:
            if h in left:
                left.remove(h)
        if not left:
            self._hints.pop(cid, None)
            self._looked.discard(cid)

    def holding(self, holders: Sequence[str]) -> _HintedBlobs:
        """A ``BlobService`` stand-in for ``PolicyFollower``: fetches try ``holders`` (the trainer) first."""
        return _HintedBlobs(self, list(holders))

    def close(self) -> None:
        self._http.close()


class _HintedBlobs:
    """What ``PolicyFollower`` uses of a BlobService (``store``, ``fetch``), with a standing hint."""

    def __init__(self, owner: HintedFetcher, holders: list[str]) -> None:
        self._owner = owner
        self._holders = holders
        self.store = owner.blobs.store

    async def fetch(self, cid: str, *, on_manifest: Callable[[Manifest], None] | None = None) -> FetchStats:
        o = self._owner
        o._hints.setdefault(cid, []).extend(self._holders)
        try:
            return await o._fetcher.fetch(cid, on_manifest=o._seen(cid, on_manifest))
        finally:
            o._unhint(cid, self._holders)


def wrong_task(task: Task, records: Sequence[RolloutRecord]) -> str:
    """Why ``records`` are not all work on the run's ``task`` ("" when they are). Every registered task
    resolves its own problem IDs (the embedded ``add3`` always), so the verifier's lookup alone would
    accept another task's work: validators and the trainer check against the run's task first."""
    for r in records:
        if r.task_id != task.task_id:
            return f"a rollout of task {clean_text(r.task_id, 80)!r}; the run's task is {task.task_id!r}"
    for pid in dict.fromkeys(r.problem_id for r in records):
        try:
            task.get(pid)
        except ConfigError:
            return f"{clean_text(pid, 80)!r} is not a problem of the run's task {task.task_id!r}"
    return ""


def group_slices(records: Sequence[RolloutRecord], group_size: int) -> list[slice] | str:
    """Slices of consecutive ``group_size`` records of one problem; a reason string if the batch is not
    made of whole groups (the trainer's advantages need them)."""
    if len(records) % group_size:
        return f"{len(records)} rollouts are not whole groups of {group_size}"
    out = []
    for start in range(0, len(records), group_size):
        ids = {r.problem_id for r in records[start:start + group_size]}
        if len(ids) != 1:
            return f"rollouts {start}..{start + group_size - 1} mix problems"
        out.append(slice(start, start + group_size))
    return out


def record_to_sample(r: RolloutRecord, reward: float) -> Sample:
    return Sample(prompt_ids=tuple(r.prompt_tokens), completion_ids=tuple(r.completion_tokens),
                  old_logprobs=tuple(r.logprobs), reward=reward, policy_version=r.policy_version,
                  task_id=r.problem_id)


def rescored_group(recs: Sequence[RolloutRecord], problem: Problem,
                   decode: Callable[[list[int]], str]) -> list[Sample] | None:
    """One group's samples with each reward recomputed from the task (a worker's claimed reward is never
    used); None when this node's checker ran out of time on one of them (``timeout``): its reward is
    unknown here, and training on it as 0 would teach the policy that a right answer is wrong (a validator
    calls the same case ``reward_unjudged``). Other reasons for a 0 (no answer, too long, a checker
    error) are the completion's own and are trained on."""
    out = []
    for r in recs:
        judged = problem.judge(decode(list(r.completion_tokens)))
        if judged.reason == "timeout":
            return None
        out.append(record_to_sample(r, judged.reward))
    return out
