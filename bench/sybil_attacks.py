"""Part 2 of ``bench/sybil.py``: each attack with one key and with many, in one table.

Driven (the real component, on 127.0.0.1, timed and measured here):

- tarpits at the trainer's prefetch: keys whose notices name blobs on a server that accepts and never
  answers; how long the honest batch's claim waits after its verdict (``roles/trainer/prefetch.py`` with
  the roles' ``Fetcher`` and budget);
- manifest bloat: keys whose notices name a small blob with a ~1 MiB manifest of one repeated chunk; what
  the trainer's budgeted fetch leaves on its disk and holds in memory;
- notice floods and fresh keys at the validator's intake: CPU per notice (gossip check, signature,
  budgets) with the keys' notices interleaved, and how many keys get a job in the first minute;
- slow-to-score answers: the CPU and wall time of one completion whose answer the ``math`` checker cannot
  finish (the validator's scoring budget and pools are applied by the model row).

Model rows combine these with part 1's verification cost and the run's defaults; each says its rule.
The rows numbered as issue 40's items (1, 3, 5, 8, 15: attacks on the run's own rules) come from
``sybil_runs.py`` and fill the last column, what the attack did to honest peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Sequence

from aiohttp import web

from bench import sybil_runs
from intellect_node.blobs.fetch import Budget, Fetcher, Provider, StaticProvider
from intellect_node.blobs.http import HttpChunkSource, blob_routes
from intellect_node.blobs.store import BlobStore
from intellect_node.config import NodeConfig
from intellect_node.envs.tasks import Problem
from intellect_node.errors import IntegrityError, TransportError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.p2p.peerbook import AUTO_BAN_AFTER
from intellect_node.protocol.blob import MAX_CHUNKS, Manifest, seal_manifest
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import RolloutNotice, notice_validator, seal_notice
from intellect_node.protocol.rollout import MAX_BATCH_SIZE, RolloutBatch
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.trainer import prefetch as prefetch_mod
from intellect_node.roles.trainer.prefetch import Prefetch
from intellect_node.roles.validator.intake import Intake, Limits

MIB = 1 << 20


@dataclass(frozen=True)
class Parts:
    """Part 1's measurements (CPU seconds) and the honest batch's size."""

    gen_s: float
    verify_s: float
    notice_s: float
    rollouts: int
    batch_bytes: int


@dataclass
class Row:
    attack: str
    keys: int
    validator_cpu: str
    delay: str
    trainer_cpu: str
    trainer_mem: str
    trainer_disk: str
    how: str
    harm: str = "-"
    """What the attack did to honest peers (blamed, framed, halted, locked out); "-": not measured."""


def _du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def _serve(store: BlobStore) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.add_routes(blob_routes(store))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
    return runner, f"http://127.0.0.1:{port}"


# -- tarpits at the trainer's prefetch ---------------------------------------------------------------


async def _tarpits(keys: int, root: Path) -> tuple[float, float, float, int]:
    """(honest claim wait s, trainer CPU s, trainer peak MiB, trainer disk bytes) with ``keys`` tarpits."""
    conns: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # silence until the connection closes (the bench closes it at the end)

    pit = await asyncio.start_server(hold, "127.0.0.1", 0)
    pit_url = f"http://127.0.0.1:{pit.sockets[0].getsockname()[1]}"
    honest_store = BlobStore(root / "honest")
    src_file = root / "batch"
    src_file.write_bytes(os.urandom(300_000))
    honest_cid, m = honest_store.add_file(src_file, SigningKey.generate())
    runner, honest_url = await _serve(honest_store)
    trainer_root = root / "trainer"
    hint: dict[str, str] = {}
    urls = {f"pit{i}": pit_url for i in range(keys)} | {"honest": honest_url}
    source = HttpChunkSource()
    fetcher = Fetcher(BlobStore(trainer_root), [source], lambda cid: _find(cid, hint, urls))

    async def fetch(worker: str, cid: str, n: int) -> tuple[bytes, RolloutBatch]:
        hint[cid] = worker
        async with asyncio.timeout(60):
            await fetcher.fetch(cid, budget=Budget(max_size=MAX_BATCH_SIZE, size=n))
        return b"", RolloutBatch(run_id="bench", policy_version=0, rollouts=[])

    pf = Prefetch(fetch)
    cpu0 = time.process_time()
    tracemalloc.start()
    try:
        for i in range(keys):
            pf.offer(f"pit{i}", cid_of(f"tarpit {i}".encode()), 5, 1 << 20, 3, 5)
        while len(conns) < min(keys, prefetch_mod.NEWCOMER_CONCURRENT):  # the tarpits hold their slots
            await asyncio.sleep(0.01)
        pf.offer("honest", honest_cid, 5, m.total_size, 3, 5)
        await asyncio.sleep(0.2)  # the validators' verdict comes
        t0 = time.monotonic()
        if await pf.claim("honest", honest_cid) is None:  # then the trainer fetches it at once
            await fetch("honest", honest_cid, m.total_size)
        wait = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()
        pf.close()
        source.close()
        pit.close()
        for w in conns:
            w.close()
        await runner.cleanup()
    cpu = time.process_time() - cpu0
    return wait, cpu, peak, _du(trainer_root) - m.total_size


async def _find(cid: str, hint: dict[str, str], urls: dict[str, str]) -> Sequence[Provider]:
    return [StaticProvider(hint[cid], urls[hint[cid]])]


# -- manifest bloat -----------------------------------------------------------------------------------


async def _bloat(keys: int, root: Path) -> tuple[float, float, int]:
    """(trainer CPU s, peak MiB, disk bytes left) after ``keys`` notices of 16 KiB blobs whose manifests
    list one 1 KiB chunk 16,384 times (a ~1 MiB manifest)."""
    mallory = BlobStore(root / "mallory")
    cids = []
    for i in range(keys):
        key = SigningKey.generate()
        data = i.to_bytes(4, "big") * 256  # one 1 KiB chunk of this key's own
        c = cid_of(data)
        atomic_write_bytes(mallory.chunk_path(c), data)
        mallory.mark_chunk(c)
        m = Manifest(name="rollouts", publisher=key.peer_id, chunk_size=len(data),
                     total_size=len(data) * MAX_CHUNKS, chunks=[c] * MAX_CHUNKS)
        cid, raw = seal_manifest(key, m)
        mallory.put_manifest(cid, raw)
        cids.append((cid, m.total_size))
    runner, url = await _serve(mallory)
    trainer_root = root / "trainer"
    src = HttpChunkSource(read_timeout=5.0)

    async def find(cid: str) -> Sequence[Provider]:
        return [StaticProvider("mallory", url)]

    f = Fetcher(BlobStore(trainer_root), [src], find, find_timeout=0.0)
    cpu0 = time.process_time()
    tracemalloc.start()
    try:
        for cid, size in cids:
            try:
                await f.fetch(cid, budget=Budget(max_size=MAX_BATCH_SIZE, size=size))
            except (IntegrityError, TransportError):
                pass  # refused: what the bench is about
        peak = tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()
        src.close()
        await runner.cleanup()
    return time.process_time() - cpu0, peak, _du(trainer_root)


# -- the validator's intake ------------------------------------------------------------------------------


def _intake(cfg: NodeConfig, keys: int, notices_each: int) -> tuple[float, int, float]:
    """(CPU s per notice, keys given a job within the first minute, peak MiB) for ``keys`` fresh keys
    each sending ``notices_each`` notices, interleaved; every job finishes at once (the cheapest case
    for the attacker's throughput)."""
    vc = cfg.validator
    intake = Intake(Limits.from_config(vc, max_batch_bytes=MAX_BATCH_SIZE))
    check = notice_validator("bench")
    signed = []
    for i in range(keys):
        key = SigningKey.generate()
        raw = seal_notice(key, RolloutNotice(run_id="bench", batch_cid=cid_of(b"%d" % i), policy_version=0,
                                             n_rollouts=64, batch_bytes=30_000))
        signed.append((raw, key.peer_id))
    started: set[str] = set()
    tracemalloc.start()
    t0 = time.process_time()
    n = 0
    for j in range(notices_each):
        for raw, peer in signed:
            notice, signer = check(raw, peer)
            intake.offer(signer, notice, j * 0.1, 0)
            n += 1
    cpu = (time.process_time() - t0) / n
    for second in range(61):
        for p in intake.take(float(second), lambda v: True, lambda w: True):
            started.add(p.worker)
            intake.done(p.worker)
    peak = tracemalloc.get_traced_memory()[1] / MIB
    tracemalloc.stop()
    return cpu, len(started), peak


# -- scoring stall ---------------------------------------------------------------------------------------


def _slow_answers(n: int) -> tuple[float, float]:
    """(wall s, CPU s incl. children) per completion the ``math`` checker times out on; distinct answers,
    so the per-(problem, answer) memo does not help."""
    p = Problem(task_id="bench-math", problem_id="bench-math/0", prompt="", answer="1", checker="math")
    p.judge(r"\boxed{1}")  # the scoring child is up before timing
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    c0, t0 = time.process_time(), time.monotonic()
    for i in range(n):
        assert p.judge(rf"\boxed{{9^{{9^{{9^{{{8 + i}}}}}}}}}").reason == "timeout"
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return (time.monotonic() - t0) / n, (time.process_time() - c0 + child) / n


# -- the table -------------------------------------------------------------------------------------------


def report(cfg: NodeConfig, parts: Parts, *, keys: int) -> None:
    rl, vc = cfg.rl, cfg.validator
    B, v = rl.ban_after, parts.verify_s
    rows: list[Row] = []
    with TemporaryDirectory() as tmp:
        root = Path(tmp)
        pit = {k: asyncio.run(_tarpits(k, root / f"pit{k}")) for k in (1, keys)}
        bloat = {k: asyncio.run(_bloat(k, root / f"bloat{k}")) for k in (1, keys)}
    intake = {k: _intake(cfg, k, 20) for k in (1, keys)}
    slow_wall, slow_cpu = _slow_answers(2)

    rows.append(Row("honest worker (baseline)", 1, f"{v:.3f}/batch", f"{v:.3f} (its own check)",
                    "-", "-", f"{parts.batch_bytes / MIB:.2f}/batch",
                    f"driven: its batch costs its worker {parts.gen_s:.3f} CPU s"))
    # Fresh keys forging batches, first-K: every batch of theirs is verified in full, B of them ban a key.
    for k in (1, keys):
        admitted = intake[k][1]
        rows.append(Row(
            "forged batches (fresh keys)", k, f"{admitted * B * v:.2f} in min 1", "0 (own slots)",
            "0", f"<= {min(k, prefetch_mod.NEWCOMER_HELD) * parts.batch_bytes / MIB:.2f}", "0",
            f"model: {admitted} keys start in the first minute (driven intake) x {B} batches x {v:.3f} s; "
            f"workers with accepted work have their own {vc.max_verifications} verification slots; the "
            f"trainer prefetches at most {prefetch_mod.NEWCOMER_HELD} newcomer batches"))
    # Slow-to-score answers under the scoring budget: a batch is refused (scoring_budget, held against
    # the worker) at its (scoring_timeouts_per_batch + 1)th time limit; its rollouts' allowance bounds it.
    allowed = vc.scoring_timeouts_per_batch + 1
    allowance = (parts.rollouts * vc.scoring_s_per_rollout
                 + vc.scoring_timeouts_per_batch * rl.reward_timeout_s)
    per_batch = min(allowed * slow_wall, allowance)
    per_batch_cpu = per_batch / slow_wall * slow_cpu
    lane_cpu = vc.scoring_processes * 60 * slow_cpu / slow_wall  # the newcomers' processes, kept busy
    for k in (1, keys):
        admitted = intake[k][1]
        cpu = min(admitted * B * per_batch_cpu, lane_cpu)
        rows.append(Row(
            "slow-to-score answers", k, f"{cpu:.0f} in min 1", "0 (own processes)", "0", "0", "0",
            f"driven: {slow_wall:.1f} s wall, {slow_cpu:.2f} CPU s an answer the math checker cannot finish; "
            f"model: a batch is refused at the time limit past its {vc.scoring_timeouts_per_batch} allowed "
            f"({per_batch:.0f} s of a newcomers' "
            f"scoring process, {per_batch_cpu:.1f} CPU s), {B} such batches ban a key, and the "
            f"{vc.scoring_processes} newcomers' processes cap it at {lane_cpu:.0f} CPU s a minute; workers "
            f"with accepted work have their own {vc.scoring_processes}"))
    for k in (1, keys):
        cpu_n, _, peak = intake[k]
        rows.append(Row(  # gossipsub forwards 10 messages/s per forwarding peer and topic
            "notice flood", k, f"{10 * cpu_n * 60:.3f}/min per peer", "~0", "0",
            f"{peak:.2f} (intake)", "0",
            f"driven: {cpu_n * 1e3:.2f} ms a notice with {k} key(s) interleaved; model: 10 notices/s "
            f"per connected peer, refused as flood past {vc.peer_notice_burst} + "
            f"{vc.peer_notices_per_min:g}/min (not a strike)"))
    for k in (1, keys):
        held = min(k, vc.max_jobs)
        rows.append(Row(
            "tarpits (validator)", k, "~0", "0 (proven workers)", "0", "0", "0",
            f"model: {held} newcomer job slot(s) held {vc.fetch_timeout_s:g} s per notice until "
            f"{vc.strikes_ban_after} strikes ban a key; proven workers have their own {vc.max_jobs}"))
    for k in (1, keys):
        wait, cpu, peak, disk = pit[k]
        rows.append(Row("tarpits (trainer prefetch)", k, "0", f"{wait:.2f}", f"{cpu:.2f}", f"{peak:.2f}",
                        f"{disk / MIB:.2f}",
                        f"driven: the honest batch's claim after its verdict behind {k} tarpit(s)"))
    for k in (1, keys):
        cpu, peak, disk = bloat[k]
        rows.append(Row("manifest bloat (trainer)", k, "0", "0", f"{cpu:.2f}", f"{peak:.2f}",
                        f"{disk / MIB:.2f}",
                        f"driven: {k} notice(s) of 16 MiB blobs with ~1 MiB manifests, refused by the "
                        "budget before storing"))
    rows += run_rule_rows(cfg, parts, keys=keys, intake={k: intake[k][1] for k in (1, keys)},
                          slow=(slow_wall, slow_cpu))

    print(f"\nWhat 1 key and {keys} keys cost an honest run (CPU s; delay: how much later an honest "
          "worker's verdict or batch comes, s; trainer memory and disk, MiB):\n")
    head = ("attack", "keys", "validator CPU", "honest delay", "trainer CPU", "trainer mem", "trainer disk",
            "honest harm")
    widths = (30, 5, 24, 22, 12, 16, 13, 30)
    print("  " + " ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        cells = (r.attack, str(r.keys), r.validator_cpu, r.delay, r.trainer_cpu, r.trainer_mem,
                 r.trainer_disk, r.harm)
        print("  " + " ".join(c.ljust(w) for c, w in zip(cells, widths)))
    print("\nHow each row was found:")
    for r in rows:
        print(f"  {r.attack} x{r.keys}: {r.how}")


def run_rule_rows(cfg: NodeConfig, parts: Parts, *, keys: int, intake: dict[int, int],
                  slow: tuple[float, float]) -> list[Row]:
    """Issue 40's items 1, 3, 5, 8 and 15 (``sybil_runs.py``): the attacks on the run's own rules."""
    vc = cfg.validator
    rows: list[Row] = []
    with TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = sybil_runs.replays(root, keys)
        frames = {k: sybil_runs.framing(k) for k in (1, keys)}
        lone = {(k, q): sybil_runs.lone_auditor(root, k, q) for k in (1, keys) for q in (1, 2)}
    bans = {k: sybil_runs.after_bans(k) for k in (1, keys)}
    base = runs[0]
    for k in (1, keys):
        r = runs[k]
        step, step0 = r.wall_s / r.steps, base.wall_s / base.steps
        cpu, cpu0 = r.cpu_s / r.steps, base.cpu_s / base.steps
        a = r.audits
        rows.append(Row(
            "1 replayed gossip (run)", k, f"{cpu:.2f}/step ({cpu / cpu0:.2f}x)",
            f"{step:.2f} s/step ({step / step0:.2f}x)", "-", "-", "-",
            f"driven: an in-process run (trainer, an auditing validator, 2 workers, run.require_audits), "
            f"{r.steps} steps; CPU of the whole run (every node) and wall time a trained step, against the "
            f"same run without replayers ({cpu0:.2f} CPU s, {step0:.2f} s a step); each key publishes every "
            f"message it hears as its own, the publisher's message is forwarded again once (gossipsub's "
            f"seen-cache keeps later copies out), half-way every copy again with the batch and audit "
            f"verdicts 6 minutes old; a node bans a key at {AUTO_BAN_AFTER} refusals "
            f"(network.auto_ban_after); {r.copies} copies sent, {r.blamed_replayers} refusals blamed on the "
            f"replayers",
            f"{r.blamed_honest} blamed; audits {a['pass']}/{a['fail']}/{a['unavailable']}; "
            f"{r.refusing} refusing"))
    for k in (1, keys):
        f = frames[k]
        who = "the run validator outside the quorum" if k == 1 else f"{k} fresh keys"
        rows.append(Row(
            "3 framing by a validator", k, f"{f.cpu_s * 1e3:.2f} ms/record ({f.cpu_s / f.honest_cpu_s:.1f}x)",
            "0", "0", "0", "0",
            f"driven: the auditor's admission check (roles/auditor/evidence.py) over {f.records} step "
            f"records, each batch accepted by a quorum of 2 of 3 validators; {who} reject(s) every batch, "
            f"dated 4 minutes before the quorum and heard 1 s after it; CPU of the auditor a record "
            f"(honest: {f.honest_cpu_s * 1e3:.2f} ms); {f.disputed} counted disputed, {f.refused} refused "
            f"at the gossip check (not a run validator's)",
            f"{f.framed} of {f.records} steps failed"))
    for k in (1, keys):
        one = lone[(k, 1)]
        halts = {q: ("halts" if lone[(k, q)].halted else "goes on") for q in (1, 2)}
        who = ("one of the run's 2 auditors fails a step" if k == 1 else
               f"{k} fresh keys each send a failing verdict and a forged hash conflict")
        rows.append(Row(
            "5 one auditor's fail", k, f"{one.cpu_s * 1e3:.2f} ms/message", "0", "0", "0", "0",
            f"driven: the audit watch every node runs (run.require_audits on): {who}; "
            f"{one.refused} refused at the gossip check and blamed on their senders",
            f"audit_quorum 1: {halts[1]}; 2: {halts[2]}"))
    per_batch = vc.scoring_timeouts_per_batch * slow[1]  # what one unjudged batch costs: its allowed limits
    lane = vc.scoring_processes * 60 * slow[1] / slow[0]
    for k in (1, keys):
        scored = intake[k] * vc.unjudged_per_version
        rows.append(Row(
            "8 unjudged batch re-sent", k, f"{min(scored * per_batch, lane):.0f}/version in min 1",
            "0 (own processes)", "0", "0", "0",
            f"model: each key gets validator.unjudged_per_version ({vc.unjudged_per_version}) batches "
            f"left reward_unjudged a version, each costing its allowed {vc.scoring_timeouts_per_batch} time "
            f"limit(s) ({per_batch:.1f} CPU s, driven above), {intake[k]} key(s) start in the first minute "
            f"(driven intake), the newcomers' {vc.scoring_processes} scoring processes cap it at "
            f"{lane:.0f} CPU s a minute; past the budget its queued batches are answered unscored and "
            f"its notices at that version not taken in (counted, tests/security/test_unjudged_verdicts.py):"
            f" the re-sender loses that version's work. Not driven: each copy is a 5 s stall of a real "
            f"checker, already measured",
            "0 (held against no one)"))
    for k in (1, keys):
        b = bans[k]
        rows.append(Row(
            "15 new peers after bans", k, "-", f"{b.honest_after_s:.2f} s connect "
            f"({b.honest_after_s / b.honest_before_s:.1f}x)", "-", "-", "-",
            f"driven: real libp2p on 127.0.0.1, a node at its default watermarks (inbound cap {b.cap}) bans "
            f"each of {k} fresh key(s) once connected, each redials once ({b.wall_s:.1f} s); then an honest "
            f"newcomer connects (before the attack: {b.honest_before_s:.2f} s); py-libp2p 0.8.1's stock "
            f"handler kept every slot (bench/inbound_soak.py: 124 cycles, then every newcomer refused)",
            f"{b.slots_in_use} of {b.cap} slots held; {b.refused_at_cap} refused"))
    return rows
