"""Part 3 of ``bench/sybil.py``: the attacks on a run's own rules, with one key and with many.

Each is driven against the real part, in this process:

1. replayed gossip: an in-process run (``intellect_node.testing.roles``: the trainer, a validator that
   audits it, two workers, ``run.require_audits``) with ``keys`` fresh keys that each publish every message
   they hear again as their own, while the publisher's own message is forwarded again once (gossipsub's
   seen-cache keeps further copies of one message out, whoever forwards them); half-way, every copy
   once more, the dated ones six minutes old. The fake peerbook bans no one by count, so the bench
   stops a key's gossip to a node once that node recorded ``network.auto_ban_after`` refusals of it, as
   the real peerbook does. Measured: wall time and the whole run's CPU per trained step against the same
   run without replayers, the honest peers blamed and the audits' outcomes;
3. framing by a validator outside the quorum: the auditor's admission check (``roles/auditor/
   evidence.py``) fed every batch's quorum and a rejection from the one run validator outside it, dated
   before the quorum and published after it; for many keys, fresh keys' rejections through the gossip
   check the auditor's verdict topic applies;
5. a lone auditor's failure: the audit watch every node runs (``roles/common/audits.py``) with
   ``run.audit_quorum`` 1 and 2, one of the run's auditors failing a step, fresh keys' failing verdicts
   and forged hash conflicts; whether the node stops following the trainer;
15. new peers after bans: a node on real libp2p at its default watermarks (inbound cap 124) that bans
   each fresh key once it is connected (each redials once), then an honest newcomer's connection time
   against one made before the attack, and the inbound slots left in use.

Item 8 (a ``reward_unjudged`` batch re-sent under new blob names) is a model row in part 2's table
(``sybil_attacks.py``): its count comes from the validator's budget and is tested; its cost is part 2's
measured time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from intellect_node.config import NodeConfig, build_config
from intellect_node.config.status import StatusBoard
from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.p2p.peerbook import AUTO_BAN_AFTER
from intellect_node.protocol import codec
from intellect_node.protocol.audits import AUDIT_DOMAIN, AUDIT_KIND, AuditVerdict, seal_verdict
from intellect_node.protocol.binding import CONFLICT_KIND, HashConflict
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.policy import PolicyAnnouncement, seal_announcement
from intellect_node.protocol.rl import VERDICT_DOMAIN, BatchVerdict, now_ms, verdict_validator
from intellect_node.protocol.signing import Envelope, SigningKey
from intellect_node.protocol.steps import StepBatch, StepRecord, StepSettings, check_record
from intellect_node.protocol.topics import topic
from intellect_node.roles.auditor.evidence import AdmissionCheck, RunRules
from intellect_node.roles.common.audits import AuditWatch


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No log lines while an attack runs (the roles' warnings about it would fill the table's screen)."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


OLD_MS = 6 * 60 * 1000
"""The stale copies' age: outside the verdicts' and the audit verdicts' five minutes."""


@dataclass(frozen=True)
class Replays:
    """One in-process run, ``keys`` replayers."""

    keys: int
    steps: int
    wall_s: float
    cpu_s: float
    copies: int  # messages the replayers sent
    blamed_honest: int  # rejections and bans of honest peers, every node
    blamed_replayers: int
    audits: dict[str, int]  # the auditor's pass / fail / unavailable
    refusing: int  # nodes refusing the trainer


# -- 1. replayed gossip, in an in-process run ---------------------------------------------------------

def _with_watch(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``factory``'s role on a node that runs the audit watch, as a joined node does (before the role)."""

    def build(node: Any) -> Any:
        watch = AuditWatch(node)
        node.services[AuditWatch] = watch
        role = factory(node)
        start = role.start

        async def both() -> None:
            await watch.start()
            await start()

        role.start = both
        return role

    return build


def _redate(data: bytes, keys: dict[str, SigningKey]) -> bytes:
    """A dated message as captured OLD_MS earlier (sealed again by its signer); anything else as it is."""
    try:
        env = codec.decode(data, Envelope, max_size=1 << 24)
    except ProtocolError:
        return data
    kinds: dict[str, type[BatchVerdict] | type[AuditVerdict]] = {VERDICT_DOMAIN: BatchVerdict,
                                                                  AUDIT_DOMAIN: AuditVerdict}
    kind = kinds.get(env.domain)
    key = keys.get(env.signer)
    if kind is None or key is None:
        return data
    msg: BatchVerdict | AuditVerdict = codec.decode(env.payload, kind, max_size=1 << 24)
    if not isinstance(msg.time_ms, int):
        return data
    return key.seal(env.domain, msgspec.structs.replace(msg, time_ms=msg.time_ms - OLD_MS))


async def _replay_run(root: Path, keys: int, steps: int) -> Replays:
    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.roles.validator.role import Validator
    from intellect_node.roles.worker.role import Worker
    from intellect_node.testing.roles import in_process_swarm, key_of, run_config

    names = ("trainer", "validator", "w1", "w2")
    honest_keys = {key_of(n).peer_id: key_of(n) for n in names}
    rl = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1,
              work_ahead=1, checkpoint_every=1000)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=rl,
                     require_audits=True)
    v_cfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update={"audit": True})})
    replayers = [SigningKey.generate().peer_id for _ in range(keys)]
    replaying = set(replayers)
    held: list[tuple[str, str, bytes]] = []
    seen: set[bytes] = set()
    sent = 0
    async with in_process_swarm(root) as net:
        trainer = await net.start("trainer", cfg, _with_watch(Trainer.for_runtime))
        validator = await net.start("validator", v_cfg, _with_watch(Validator.for_runtime))
        workers = [await net.start(w, cfg, _with_watch(Worker.for_runtime)) for w in ("w1", "w2")]
        nodes = [trainer, validator, *workers]
        loop = asyncio.get_running_loop()
        strikes = {n.name: Counter[str]() for n in nodes}  # refusals of each replayer at each node
        scanned = {n.name: 0 for n in nodes}

        def banned(n: Any, origin: str) -> bool:
            """The peerbook's automatic ban (``network.auto_ban_after``), which the fake leaves out."""
            book = n.swarm.peerbook
            for peer, _ in book.rejections[scanned[n.name]:]:
                strikes[n.name][peer] += 1
            scanned[n.name] = len(book.rejections)
            if strikes[n.name][origin] >= AUTO_BAN_AFTER:
                book.ban(origin, "auto")
            return bool(book.is_banned(origin))

        def send(origin: str, name: str, data: bytes) -> None:
            nonlocal sent
            for n in nodes:
                if origin not in replaying or not banned(n, origin):
                    loop.call_soon(n.swarm.receive, origin, name, data)
            sent += 1

        def heard(name: str, data: bytes, origin: str) -> None:
            digest = hashlib.sha256(name.encode() + data).digest()
            if origin in replaying or digest in seen:
                return
            seen.add(digest)
            held.append((name, origin, data))
            send(origin, name, data)  # the publisher's message again: once, the seen-cache keeps the rest out
            for r in replayers:  # and each key's own publication of the same bytes
                send(r, name, data)

        if keys:
            spy = await net.start("spy", cfg, None, key=SigningKey.generate(), ledger=False)
            for name in sorted({t for n in nodes for t in n.swarm.subscriptions}):
                def on_heard(data: bytes, origin: str, name: str = name) -> None:
                    heard(name, data, origin)

                spy.swarm.subscribe(name, lambda data, origin: data, on_heard)

        def audit() -> dict[str, Any]:
            st: dict[str, Any] = validator.status()["audit"]
            return st

        async def until(step: int) -> None:
            end = time.monotonic() + 600
            while not (trainer.role.step >= step and audit()["last"].get("version", 0) >= step):
                if net.failures() or audit()["fail"] or time.monotonic() > end:
                    raise RuntimeError(f"the run stopped at step {trainer.role.step}: {net.failures()}, "
                                       f"{audit()}")
                await asyncio.sleep(0.05)

        await until(1)  # started: the attack and the clocks begin here
        t0, c0, start = time.monotonic(), time.process_time(), trainer.role.step
        await until(start + steps // 2)
        for name, origin, data in list(held) if keys else ():  # every copy again, dated ones 6 min old
            old = _redate(data, honest_keys)
            send(origin, name, old)
            for r in replayers:
                send(r, name, old)
        await until(start + steps)
        wall, cpu, done = time.monotonic() - t0, time.process_time() - c0, trainer.role.step - start
        honest = set(honest_keys)
        books = [n.swarm.peerbook for n in nodes]
        blamed = sum(1 for b in books for p, _ in b.rejections if p in honest) + \
            sum(1 for n in nodes for p in {**n.swarm.banned, **n.swarm.peerbook.bans} if p in honest)
        against = sum(1 for b in books for p, _ in b.rejections if p in replayers)
        refusing = sum(1 for n in nodes if (w := n.service(AuditWatch)) is not None and w.refusal())
        a = audit()
        return Replays(keys, done, wall, cpu, sent, blamed, against,
                       {k: a[k] for k in ("pass", "fail", "unavailable")}, refusing)


def replays(root: Path, keys: int, steps: int = 6) -> dict[int, Replays]:
    """The run without replayers, with one and with ``keys``."""
    with quiet():
        return {k: asyncio.run(_replay_run(root / f"replay{k}", k, steps)) for k in (0, 1, keys)}


# -- 3. a validator outside the quorum framing the trainer ---------------------------------------------

SETTINGS = StepSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, group_size=2, clip_eps_low=0.2,
                        clip_eps_high=0.2, neg_ratio_cap=1.0, max_grad_norm=1.0, token_budget=100,
                        kl_coef=0.0, entropy_coef=0.0, scale_by_std=True, temperature=1.0, micro_tokens=None,
                        compute_dtype=None)


@dataclass(frozen=True)
class Framing:
    keys: int
    records: int
    framed: int  # records the auditor failed
    disputed: int
    refused: int  # rejections the gossip check refused (not a run validator's)
    cpu_s: float  # the auditor's CPU per record checked, rejections included
    honest_cpu_s: float  # the same per record with no rejection heard


def framing(keys: int, records: int = 200) -> Framing:
    """``records`` step records, each taking one batch two of the run's three validators accepted (the
    quorum); the attack: a rejection of each batch dated four minutes before the quorum and heard a
    second after it, from the third run validator (``keys`` 1) or from ``keys`` fresh keys."""
    run, worker = "bench", SigningKey.generate()
    v1, v2, outside = (SigningKey.generate() for _ in range(3))
    rules = RunRules(run, frozenset({v1.peer_id, v2.peer_id, outside.peer_id}), quorum=2, async_level=2)
    check = verdict_validator(run, rules.validators)
    hostile = [outside] if keys == 1 else [SigningKey.generate() for _ in range(keys)]

    def verdict(cid: str, key: SigningKey, accepted: bool, time_ms: int) -> bytes:
        return key.seal(VERDICT_DOMAIN, BatchVerdict(
            run_id=run, batch_cid=cid, worker=worker.peer_id, policy_version=0, accepted=accepted,
            n_accepted=4 if accepted else 0, n_rejected=0 if accepted else 4,
            reason="" if accepted else "reward", time_ms=time_ms))

    def one(attacked: bool) -> tuple[int, int, int, float]:
        adm = AdmissionCheck(rules)
        framed = refused = 0
        cpu = 0.0
        for seq in range(records):
            cid = cid_of(f"batch {seq}".encode())
            now = now_ms()
            accepts = [verdict(cid, k, True, now) for k in (v1, v2)]
            rejects = [verdict(cid, k, False, now - 240_000) for k in hostile] if attacked else []
            c = time.process_time()
            for raw, k in zip(accepts, (v1, v2)):
                v, signer = check(raw, k.peer_id)
                adm.heard(v, signer, 0, at=seq * 10.0)
            for raw, k in zip(rejects, hostile):
                try:
                    v, signer = check(raw, k.peer_id)
                except (ProtocolError, MessageIgnored):
                    refused += 1
                    continue
                adm.heard(v, signer, 0, at=seq * 10.0 + 1.0)
            rec = check_record(StepRecord(
                run_id=run, seq=seq + 1, step=seq + 1, base_version=0, base_hash=cid_of(b"w0"), version=1,
                checkpoint_hash=cid_of(b"w1"), settings=SETTINGS,
                batches=[StepBatch(cid=cid, worker=worker.peer_id, groups=2, trained=[0], evidence=accepts)]))
            framed += bool(adm.check(rec))
            cpu += time.process_time() - c
        return framed, adm.disputed, refused, cpu / records

    _, _, _, honest_cpu = one(False)
    framed, disputed, refused, cpu = one(True)
    return Framing(keys, records, framed, disputed, refused, cpu, honest_cpu)


# -- 5. one auditor's failure ---------------------------------------------------------------------------

class _Swarm:
    """What the audit watch uses of a swarm: the subscriptions, and a record of rejections."""

    def __init__(self) -> None:
        self.subs: dict[str, tuple[Any, Any]] = {}
        self.peerbook = self
        self.rejections: list[str] = []

    def subscribe(self, name: str, validate: Any, handler: Any, *, include_own: bool = False) -> None:
        self.subs[name] = (validate, handler)

    def record_rejection(self, peer: str, reason: str, *, counts: bool = True) -> None:
        self.rejections.append(peer)


@dataclass
class _Runtime:
    config: NodeConfig
    data_dir: Path
    swarm: _Swarm
    board: StatusBoard

    def service(self, kind: type[Any]) -> None:
        return None


@dataclass(frozen=True)
class LoneAuditor:
    keys: int
    quorum: int
    halted: bool  # the node stopped following the trainer
    refused: int  # messages refused at the gossip check (blamed on their sender)
    cpu_s: float  # CPU per message


def lone_auditor(root: Path, keys: int, quorum: int) -> LoneAuditor:
    """The audit watch of a node of a run with two auditors, ``run.audit_quorum`` ``quorum``: ``keys`` 1 is
    one of the auditors failing step 1 (its key stolen, or wrong); more keys are fresh keys each sending a
    failing verdict of step 1 and a forged hash conflict (two announcements of v1 they signed)."""
    trainer, a1, a2 = (SigningKey.generate() for _ in range(3))
    run = "bench"
    cfg = build_config(run={"run_id": run, "trainer_peer_id": trainer.peer_id,
                            "validator_peer_ids": [a1.peer_id, a2.peer_id], "require_audits": True,
                            "audit_quorum": quorum})
    sw = _Swarm()
    watch = AuditWatch(_Runtime(cfg, root / f"watch{keys}-{quorum}", sw, StatusBoard()))  # type: ignore[arg-type]
    hostile = [a1] if keys == 1 else [SigningKey.generate() for _ in range(keys)]

    def fail(key: SigningKey) -> bytes:
        return seal_verdict(key, AuditVerdict(run_id=run, trainer=trainer.peer_id, seq=1, version=1,
                                              outcome="fail", published=cid_of(b"published"),
                                              expected=cid_of(b"replayed"), reason="replay differs"))

    def conflict(key: SigningKey) -> bytes:
        anns = [seal_announcement(key, PolicyAnnouncement(
            run_id=run, version=1, dtype="F32", checkpoint_hash=cid_of(f"w1 {i}".encode()), checkpoint_size=1,
            full_version=1, full_cid=cid_of(f"full {i}".encode()), full_size=1)) for i in range(2)]
        return codec.encode(HashConflict(run_id=run, version=1, first=anns[0], second=anns[1]))

    async def main() -> tuple[int, float]:
        await watch.start()
        msgs = [(topic(run, AUDIT_KIND), fail(k), k.peer_id) for k in hostile]
        if keys > 1:
            msgs += [(topic(run, CONFLICT_KIND), conflict(k), k.peer_id) for k in hostile]
        refused = 0
        c = time.process_time()
        for name, data, origin in msgs:
            validate, handler = sw.subs[name]
            try:
                msg = validate(data, origin)
            except MessageIgnored:
                continue
            except ProtocolError:
                sw.record_rejection(origin, "refused")
                refused += 1
                continue
            result = handler(msg, origin)
            if asyncio.iscoroutine(result):
                await result
        return refused, (time.process_time() - c) / len(msgs)

    with quiet():
        refused, cpu = asyncio.run(main())
    return LoneAuditor(keys, quorum, bool(watch.refusal()), refused, cpu)


# -- 15. new peers after bans, on real libp2p ------------------------------------------------------------

@dataclass(frozen=True)
class AfterBans:
    keys: int
    honest_before_s: float  # an honest newcomer's connection time before the attack
    honest_after_s: float
    slots_in_use: int  # inbound slots still taken once the banned keys are gone
    cap: int
    refused_at_cap: int
    wall_s: float


async def _after_bans(keys: int, parallel: int = 8) -> AfterBans:
    from intellect_node.errors import TransportError
    from intellect_node.p2p import compat
    from intellect_node.p2p.connmgr import ConnLimits
    from intellect_node.p2p.swarm import Swarm

    compat.apply_fixes()

    async def fresh() -> Swarm:
        return await Swarm.start(SigningKey.generate(), run_id="bench", listen=["/ip4/127.0.0.1/tcp/0"],
                                 http_url="http://127.0.0.1:1", conn=ConnLimits(low=1, high=4))

    async def until(pred: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + 30
        while not pred():
            if time.monotonic() > end:
                raise TimeoutError(what)
            await asyncio.sleep(0.02)

    target = await Swarm.start(SigningKey.generate(), run_id="bench", listen=["/ip4/127.0.0.1/tcp/0"],
                               http_url="http://127.0.0.1:1", conn=ConnLimits.from_config(build_config()))
    addr = target.listen_addrs()[0]

    async def honest() -> float:
        sw = await fresh()
        try:
            t = time.monotonic()
            await sw.connect(addr)
            await until(lambda: sw.peer_id in target.connected_peers(), "the honest newcomer")
            return time.monotonic() - t
        finally:
            await sw.close()

    async def attacker() -> None:
        sw = await fresh()
        try:
            await sw.connect(addr)
            await until(lambda: sw.peer_id in target.connected_peers(), "an attacker connected")
            await target.ban(sw.peer_id, "bench: banned")
            await until(lambda: sw.peer_id not in target.connected_peers(), "an attacker closed")
            with contextlib.suppress(TransportError, OSError):  # it redials: refused after the handshake
                await sw.connect(addr)
        finally:
            await sw.close()

    try:
        before = await honest()
        t0 = time.monotonic()
        shares = [keys // parallel + (1 if i < keys % parallel else 0) for i in range(parallel)]

        async def dialer(n: int) -> None:
            for _ in range(n):
                await attacker()

        await asyncio.gather(*(dialer(n) for n in shares))
        wall = time.monotonic() - t0
        with contextlib.suppress(TimeoutError):
            await until(lambda: target.inbound().in_use == 0, "the slots return")
        in_use = target.inbound().in_use
        after = await honest()
        return AfterBans(keys, before, after, in_use, target.inbound().cap, target.inbound().refused, wall)
    finally:
        await target.close()


def after_bans(keys: int) -> AfterBans:
    with quiet():
        return asyncio.run(_after_bans(keys))
