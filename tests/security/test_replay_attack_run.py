"""A run under a replayer keeps training, audited, with no honest peer blamed (issue 40).

In one process (``intellect_node.testing.roles``): the trainer, a validator that audits it
(``validator.audit``) and evaluates held-out problems (``validator.evaluate``), two workers, every node
with its audit watch and ``run.require_audits`` on, and a fresh key that subscribes to every topic the
run uses (``tests/support/replayer.py``). It sends every message it hears again, at once: twice as its
own publication of the same signed bytes, and once as the original publisher's message (what libp2p
forwards once the seen-cache forgot it). Later it sends every copy it kept again both ways, the dated
ones (batch and audit verdicts, held-out results) as captured six minutes before: outside every window.
Heartbeats, run listings and sweep messages are not in an in-process run: their replays are
``tests/security/test_replayed_gossip.py``'s (real libp2p).

Checked after each phase: the trainer trained more steps, the auditor passed them and never failed or
missed one, no node refuses the trainer, no honest node recorded a rejection against an honest peer or
banned one, no verdict rejected honest work; and the replays did arrive (the repeats and stale copies
the nodes ignored, the publications refused as not their publisher's, blamed on the replayer).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.audits import AuditWatch
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import InProcessNode, in_process_swarm, key_of, run_config
from tests.support.replayer import Replayer, watched
from tests.support.wait import wait_until

RL: dict[str, Any] = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4,
                          batches_per_version=1, work_ahead=1, checkpoint_every=1000)
STEPS = 3
"""Trained (and audited) steps waited for after each phase of the attack starts."""
OLD_MS = 6 * 60 * 1000
"""The stale copies' age: past the verdicts' five minutes and the audit verdicts' five."""
NAMES = ("trainer", "validator", "w1", "w2")


def _blamed(node: InProcessNode, honest: set[str]) -> list[Any]:
    """What ``node`` holds against an honest peer: rejections recorded and bans."""
    sw = node.swarm
    return ([r for r in sw.peerbook.rejections if r[0] in honest]
            + [b for b in {**sw.banned, **sw.peerbook.bans}.items() if b[0] in honest])


def test_a_replayer_of_every_message_costs_an_audited_run_nothing(tmp_path: Path) -> None:
    keys = {name: key_of(name) for name in NAMES}
    honest = {k.peer_id for k in keys.values()}
    cfg = run_config(trainer=keys["trainer"].peer_id, validators=[keys["validator"].peer_id], rl=RL,
                     require_audits=True, eval_every=2, eval_problems=16)
    v_cfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update={"audit": True,
                                                                                 "evaluate": True})})

    async def main() -> dict[str, Any]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, watched(Trainer.for_runtime))
            validator = await net.start("validator", v_cfg, watched(Validator.for_runtime))
            workers = [await net.start(w, cfg, watched(Worker.for_runtime)) for w in ("w1", "w2")]
            nodes = [trainer, validator, *workers]
            mallory = await net.start("mallory", cfg, None, key=SigningKey.generate(), ledger=False)
            replayer = Replayer(net, mallory, keys.values())
            topics = replayer.listen()

            def audit() -> dict[str, Any]:
                st = validator.status()["audit"]
                assert isinstance(st, dict)
                return st

            async def trains_on(what: str) -> None:
                """STEPS more trained steps, each audited (or a failure or a miss, which the checks name)."""
                end = trainer.role.step + STEPS
                await wait_until(lambda: trainer.role.step >= end and audit()["last"].get("version", 0) >= end
                                 or audit()["fail"] + audit()["unavailable"] > 0 or net.failures(),
                                 timeout=120, what=f"{STEPS} more steps trained and audited {what}")
                assert not net.failures(), net.failures()
                a = audit()
                assert a["fail"] == 0 and a["unavailable"] == 0 and a["pass"] >= end, a
                for node in nodes:
                    watch = node.service(AuditWatch)
                    assert watch is not None
                    st = watch.status()
                    assert st["failed"] == 0 and not st["refusing"] and st["refused_verdicts"] == 0, \
                        (node.name, st)
                    assert _blamed(node, honest) == [], (node.name, _blamed(node, honest))
                for node in (validator, *workers):
                    assert node.status()["audit_refusal"] == "", node.name
                v = validator.status()
                assert v["rejected"] == 0 and v["banned"] == 0 and v["strikes_by_worker"] == {}, v
                # a replayed notice is not checked again, nor its batch's verdict looked up again
                assert v["reused"] == 0 and v["duplicate"] == 0, v
                assert v["verified"] <= sum(w.role.batches for w in workers), v
                for w in workers:  # each validator's verdict on a batch counted once, replays or not
                    st = w.status()
                    assert st["rejected"] == 0, st
                    assert st["accepted"] <= st["batches"], st
                t = trainer.role.intake.counts
                assert t["rejected_batches"] == 0 and t["banned"] == 0 and t["duplicate_batches"] == 0, t

            await trains_on("while every message is replayed at once")
            # the evaluation runs behind verification (its own thread, lowest priority): wait for the
            # first held-out result to be out, and replayed, whatever the machine's load
            await wait_until(lambda: replayer.sent.get("evals", 0) > 0, timeout=120,
                             what="a held-out result published and replayed")
            await replayer.drain()
            first = dict(replayer.sent)
            held = await replayer.replay_stale(OLD_MS)
            await trains_on("after every message was replayed stale")
            # evaluation goes on too (behind verification, skipping versions when it falls behind)
            await wait_until(lambda: validator.status()["held_out"]["evaluated"] >= 2, timeout=120,
                             what="a second held-out evaluation")
            await replayer.drain()
            watches = {n.name: n.service(AuditWatch) for n in nodes}
            return {"topics": topics, "first": first, "held": held, "stale": dict(replayer.stale),
                    "ignored": {name: dict(w.ignored) for name, w in watches.items() if w is not None},
                    "replayed_notices": validator.status()["replayed"],
                    "held_out": validator.status()["held_out"],
                    "expired": trainer.role.intake.counts["expired_verdicts"],
                    "blamed_mallory": sum(1 for n in nodes for p, _ in n.swarm.peerbook.rejections
                                          if p == replayer.peer_id)}

    out = asyncio.run(main())
    # The attack reached every topic the run uses, and the nodes saw it for what it was.
    assert {"rollouts", "verdicts", "policy", "steps", "audits", "evals"} <= set(out["first"]), out
    assert out["held"] > 0 and out["stale"]["verdicts"] > 0 and out["stale"]["audits"] > 0, out
    assert out["replayed_notices"] > 0, out  # a worker's notice forwarded again: not verified twice
    assert out["expired"] > 0, out  # stale verdicts: ignored at the trainer
    assert out["held_out"]["evaluated"] >= 2 and out["held_out"]["refused"] == 0, out
    for name, ignored in out["ignored"].items():
        assert ignored["repeat"] > 0 and ignored["stale"] > 0, (name, out)
    assert out["blamed_mallory"] > 0, out  # someone else's signed messages under its own name
