"""Sweep services on a node: the coordinator and the worker, talking over the run's ``sweep`` topic.

Both plug into :class:`~intellect_node.node.runtime.NodeRuntime` as services (``start``/``close``/
``status``) and use only the Swarm facade. Messages are :mod:`intellect_node.protocol.sweep` envelopes;
the gossip validator decodes and verifies them and insists that the envelope's signer is the libp2p
publisher, so a result is attributable to the peer that sent it.

Coordinator: wraps the pure :class:`~intellect_node.research.sweep.Coordinator`. Every input (claim,
result, tick) is applied, the emitted events are appended to the journal (fsync), and only then are
grants published. It offers a window of open jobs every ``offer_interval`` seconds, expires the grants
of peers the heartbeats declare gone, bans peers the state machine catches lying (``swarm.ban``), and
writes ``results.jsonl``/``summary.json``/``plot.png`` when the sweep is finished. With ``min_workers``
it holds claims until that many distinct workers have asked, then serves them all at once, so every
local worker starts with a job.

Worker: claims when idle, runs granted jobs one at a time in a daemon thread (torch, one thread; never
on the event loop, and a daemon thread so a node stops without waiting out a long run), and publishes
signed results. It ships no way to cheat: the tests' dishonest workers subclass it in tests/support.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar

from intellect_node.aioutil import cancel_and_wait
from intellect_node.errors import IntellectNodeError, ProtocolError
from intellect_node.protocol import sweep as wire
from intellect_node.protocol.topics import topic
from intellect_node.research import sweep as research

if TYPE_CHECKING:
    from intellect_node.p2p.swarm import Swarm
    from intellect_node.research.polysemanticity import RunResult
    from intellect_node.research.sweep.coordinator import ResultRecord

T = TypeVar("T")

log = logging.getLogger(__name__)

OFFER_WINDOW = 16
"""Specs per offer (about 100 bytes each): enough for every idle worker to pick from."""
CLAIM_RETRY_S = 3.0
"""An idle worker re-claims this often while a sweep is open (a lost claim or grant costs no more)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _validator(swarm: Swarm) -> Callable[[bytes, str], tuple[wire.SweepMessage, str]]:
    def validate(data: bytes, origin: str) -> tuple[wire.SweepMessage, str]:
        msg, signer = wire.open_message(data, run_id=swarm.run_id, now_ms=_now_ms())
        if signer != origin:
            raise ProtocolError(f"sweep message signed by {signer} published by {origin}")
        return msg, signer
    return validate


async def run_in_daemon_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a fresh daemon thread; awaitable from the loop, abandoned (not joined) at exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: T) -> None:
        if not fut.done():
            fut.set_result(value)

    def fail(exc: BaseException) -> None:
        if not fut.done():
            fut.set_exception(exc)

    def body() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed to the awaiting task, which decides
            loop.call_soon_threadsafe(fail, exc)
        else:
            loop.call_soon_threadsafe(settle, value)

    threading.Thread(target=body, name="sweep-job", daemon=True).start()
    return await fut


# -- coordinator -------------------------------------------------------------------------------------

class SweepCoordinatorService:
    name = "sweep_coordinator"

    def __init__(self, swarm: Swarm, coord: research.Coordinator, journal: research.Journal, *,
                 sweep_id: str, out: Path, meta: dict[str, object] | None = None, min_workers: int = 0,
                 offer_interval: float = 2.0, tick_interval: float = 1.0) -> None:
        self.swarm = swarm
        self.coord = coord
        self.journal = journal
        self.sweep_id = sweep_id
        self.out = Path(out)
        self.meta = dict(meta or {})
        self.min_workers = min_workers
        self.offer_interval = offer_interval
        self.tick_interval = tick_interval
        self.topic = topic(swarm.run_id, "sweep")
        self.done = asyncio.Event()
        self.summary: dict[str, object] | None = None
        self.workers_seen: set[str] = set()
        self._held: dict[str, wire.Claim] = {}
        self._serving = min_workers <= 0
        self.started_at = time.monotonic() if self._serving else 0.0
        """When grants began (monotonic): the sweep's own wall time excludes waiting for workers."""
        self._finishing = False
        self._tasks: list[asyncio.Task[None]] = []
        self.grants_sent = 0
        self.results_in = 0

    async def start(self) -> None:
        self.swarm.subscribe(self.topic, _validator(self.swarm), self._on_message)
        self._tasks = [asyncio.create_task(self._offer_loop(), name="sweep-offer"),
                       asyncio.create_task(self._tick_loop(), name="sweep-tick")]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._persist()
        self.journal.close()

    def status(self) -> dict[str, object]:
        return {"sweep_id": self.sweep_id, **self.coord.counts(), "workers_seen": len(self.workers_seen),
                "grants_sent": self.grants_sent, "results_in": self.results_in,
                "banned": dict(self.coord.banned)}

    def _persist(self) -> None:
        """Journal what the state machine emitted; called before anything goes out."""
        self.journal.append(self.coord.drain())

    async def _on_message(self, item: tuple[wire.SweepMessage, str], origin: str) -> None:
        msg, signer = item
        if msg.sweep_id != self.sweep_id:
            return  # another sweep on the same run: not ours to judge
        if isinstance(msg, wire.Claim) and msg.coordinator == self.swarm.peer_id:
            self.workers_seen.add(signer)
            if not self._serving:
                self._held[signer] = msg
                if len(self.workers_seen) < self.min_workers:
                    return
                self._serving = True
                self.started_at = time.monotonic()
                log.info("%d workers present; starting the sweep", len(self.workers_seen))
                for peer, claim in list(self._held.items()):
                    await self._serve_claim(peer, claim)
                self._held.clear()
                return
            await self._serve_claim(signer, msg)
        elif isinstance(msg, wire.Result) and msg.coordinator == self.swarm.peer_id:
            await self._on_result(signer, msg)

    async def _serve_claim(self, peer: str, claim: wire.Claim) -> None:
        grants = self.coord.claim(peer, claim.job_ids, claim.capacity, time.time())
        self._persist()
        if not grants:
            return
        grant = wire.Grant(run_id=self.swarm.run_id, sweep_id=self.sweep_id, time_ms=_now_ms(), worker=peer,
                           assignments=[wire.Assignment(job=g.spec, deadline_ms=int(g.deadline * 1000))
                                        for g in grants])
        self.grants_sent += len(grants)
        await self.swarm.publish(self.topic, wire.seal(self.swarm.key, grant))

    async def _on_result(self, peer: str, msg: wire.Result) -> None:
        self.results_in += 1
        record: ResultRecord = {
            "polysemantic": msg.polysemantic, "sign_hash": msg.sign_hash, "final_loss": msg.final_loss,
            "fourth_norm": [[s, v] for s, v in msg.fourth_norm], "seconds": msg.seconds}
        outcome = self.coord.result(peer, msg.job_id, record, time.time())
        self._persist()
        if not outcome.accepted and outcome.reason not in ("duplicate", "banned"):
            self.swarm.peerbook.record_rejection(peer, f"sweep result: {outcome.reason}")
        for liar in outcome.banned:
            await self.swarm.ban(liar, f"sweep: {self.coord.banned.get(liar, 'wrong results')}")
        c = self.coord.counts()
        log.info("sweep %s: %d/%d done, %d in flight, %d banned", self.sweep_id, c["done"], c["jobs"],
                 c["inflight"], c["banned"])
        await self._maybe_finish()

    async def _maybe_finish(self) -> None:
        if self._finishing or not self.coord.finished():
            return
        self._finishing = True  # the tick loop and a result handler may both get here
        meta = {**self.meta, "sweep_id": self.sweep_id, "counts": self.coord.counts(),
                "elapsed_s": round(time.monotonic() - self.started_at, 3) if self.started_at else None,
                "executions": sum(len(j.votes) for j in self.coord.jobs.values())}
        # Snapshot on the loop (handlers keep mutating the coordinator); files and plot in a thread.
        rows, banned = self.coord.rows(), dict(self.coord.banned)
        self.summary = await asyncio.to_thread(research.write_report, self.out, rows, banned, meta=meta)
        log.info("sweep %s finished: outputs in %s", self.sweep_id, self.out)
        self.done.set()
        await self._offer()

    async def _offer(self) -> None:
        finished = self.coord.finished()
        offer = wire.Offer(run_id=self.swarm.run_id, sweep_id=self.sweep_id, time_ms=_now_ms(),
                           open_jobs=self.coord.counts()["open"], finished=finished,
                           jobs=[] if finished else self.coord.open_jobs(OFFER_WINDOW))
        await self.swarm.publish(self.topic, wire.seal(self.swarm.key, offer))

    async def _offer_loop(self) -> None:
        while True:
            try:
                await self._offer()
            except IntellectNodeError as exc:  # a transient publish failure; the next offer follows
                log.warning("sweep offer not published: %s", exc)
            await asyncio.sleep(self.offer_interval)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval)
            now = time.time()
            holders = {p for j in self.coord.jobs.values() for p in j.inflight}
            for peer in holders:
                if self.swarm.peerbook.state(peer) == "gone":
                    log.info("worker %s is gone; its jobs go back to the pool", peer)
                    self.coord.peer_gone(peer, now)
            self.coord.tick(now)
            self._persist()
            await self._maybe_finish()


# -- worker ------------------------------------------------------------------------------------------

def _warm_up() -> None:
    from intellect_node.research import polysemanticity  # noqa: F401  (imports torch)


class SweepWorker:
    name = "sweep_worker"

    def __init__(self, swarm: Swarm, *, coordinators: set[str] | None = None,
                 execute: Callable[[wire.JobSpec], RunResult] = research.execute,
                 runner: Callable[[Callable[[], RunResult]], Awaitable[RunResult]] = run_in_daemon_thread
                 ) -> None:
        self.swarm = swarm
        self.coordinators = set(coordinators or ())  # empty: follow any coordinator's sweep
        self._execute = execute
        self._runner = runner
        self.topic = topic(swarm.run_id, "sweep")
        self.sweep: tuple[str, str] | None = None  # (coordinator, sweep_id) being worked on
        self._finished: set[tuple[str, str]] = set()
        self._offered: list[str] = []
        self._queue: deque[wire.Assignment] = deque()
        self._wake = asyncio.Event()
        self._claimed_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.jobs_done = 0
        self.busy = False

    async def start(self) -> None:
        self.swarm.subscribe(self.topic, _validator(self.swarm), self._on_message)
        self._task = asyncio.create_task(self._loop(), name="sweep-worker")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, object]:
        return {"sweep": self.sweep[1] if self.sweep else None, "jobs_done": self.jobs_done,
                "queued": len(self._queue), "busy": self.busy}

    def _on_message(self, item: tuple[wire.SweepMessage, str], origin: str) -> None:
        msg, signer = item
        if self.coordinators and signer not in self.coordinators:
            return
        key = (signer, msg.sweep_id)
        if isinstance(msg, wire.Offer):
            if msg.finished:
                self._finished.add(key)
                if self.sweep == key:
                    self.sweep = None
                return
            if key in self._finished or (self.sweep is not None and self.sweep != key):
                return
            self.sweep = key
            self._offered = [wire.job_id(s) for s in msg.jobs]
            self._wake.set()
        elif isinstance(msg, wire.Grant) and msg.worker == self.swarm.peer_id and key == self.sweep:
            queued = {wire.job_id(a.job) for a in self._queue}
            self._queue.extend(a for a in msg.assignments if wire.job_id(a.job) not in queued)
            self._claimed_at = 0.0
            self._wake.set()

    async def _loop(self) -> None:
        # Import torch and the model before the first claim, so job timings do not include it.
        await asyncio.to_thread(_warm_up)
        while True:
            if self._queue and self.sweep is not None:
                await self._run(self._queue.popleft(), self.sweep)
                continue
            if self.sweep is not None and time.monotonic() - self._claimed_at > CLAIM_RETRY_S:
                await self._claim(self.sweep)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), CLAIM_RETRY_S)
            except asyncio.TimeoutError:
                pass

    async def _claim(self, sweep: tuple[str, str]) -> None:
        coordinator, sweep_id = sweep
        claim = wire.Claim(run_id=self.swarm.run_id, sweep_id=sweep_id, time_ms=_now_ms(),
                           coordinator=coordinator, job_ids=self._offered[:4], capacity=1)
        self._claimed_at = time.monotonic()
        await self.swarm.publish(self.topic, wire.seal(self.swarm.key, claim))

    async def _run(self, a: wire.Assignment, sweep: tuple[str, str]) -> None:
        if a.deadline_ms < _now_ms():
            return  # the coordinator has given it to someone else by now
        spec, t0 = a.job, time.monotonic()
        self.busy = True
        try:
            result = await self._runner(lambda: self._execute(spec))
        except (IntellectNodeError, ValueError, RuntimeError) as exc:
            # its grant expires; another peer runs it
            log.error("job %s failed here: %s", wire.job_id(spec), exc)
            return
        finally:
            self.busy = False
        msg = wire.Result(run_id=self.swarm.run_id, sweep_id=sweep[1], time_ms=_now_ms(),
                          coordinator=sweep[0], job_id=wire.job_id(spec), polysemantic=result.polysemantic,
                          sign_hash=result.sign_hash,
                          # A diverged run's NaN loss would fail every validator; the digest is what counts.
                          final_loss=result.final_loss if math.isfinite(result.final_loss) else -1.0,
                          fourth_norm=list(result.fourth_norm),
                          seconds=round(time.monotonic() - t0, 3))
        await self.swarm.publish(self.topic, wire.seal(self.swarm.key, msg))
        self.jobs_done += 1
        log.info("job %s (n=%d m=%d seed=%d) done in %.1fs", msg.job_id[-8:], spec.n, spec.m, spec.seed,
                 msg.seconds)
