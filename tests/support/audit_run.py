"""Audit runs of real processes: what each node reports about the audits, the records, the dishonest trainer.

Used by ``tests/roles/test_audit_nudge.py`` (its run of processes) and ``test_audit_dishonest.py`` (``RL``,
``records`` and ``verdicts``, in process).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from intellect_node.fsutil import read_jsonl
from tests.support.ports import reserved_port
from tests.support.roles import ENV, RoleRun, listen_addr, write_config
from tests.support.swarm import NodeProcess

RL: dict[str, Any] = dict(group_size=8, problems_per_batch=4, groups_per_step=4, max_new_tokens=5,
                          batches_per_version=2, work_ahead=1, checkpoint_every=1000, ban_after=1000, lr=5e-4)
"""The embedded model, a step one batch of four groups of eight five-token rollouts.

The tests wait for steps that train, and a step whose groups all have equal rewards trains nothing (no
new version: the step record gives the workers their batches back, and the time went to rollouts that
taught nothing). Four groups a step (not two) and a small learning rate keep most steps training:
the embedded model passes few problems, a group of eight often has no pass at all, and a larger step
soon makes its rewards all zero. ``work_ahead`` 1: the next version's batches are made while this one
trains. ``checkpoint_every`` 1000: one window, from version 0."""


def audit_of(proc: NodeProcess) -> dict[str, Any]:
    """An auditing validator's own audit state (``validator.audit`` in its status)."""
    st = proc.status()["validator"]["audit"]
    assert isinstance(st, dict), st
    return st


def audits_seen(proc: NodeProcess) -> dict[str, Any]:
    """What a node makes of the auditors' verdicts (``snapshot.audits``: every node runs the watch)."""
    a = proc.status()["snapshot"]["audits"]
    assert isinstance(a, dict), a
    return a


def role_status(proc: NodeProcess, role: str) -> dict[str, Any]:
    st = proc.status()[role]
    assert isinstance(st, dict), st
    return st


def verdicts(data_dir: Path) -> list[dict[str, Any]]:
    """An auditor's verdicts in order (``auditor/verdicts.jsonl`` under its data dir)."""
    return read_jsonl(data_dir / "auditor" / "verdicts.jsonl")


def records(trainer_dir: Path) -> dict[int, dict[str, Any]]:
    """The trainer's step records by seq, as published (``trainer/records/``): base and new version, the
    batches taken (cid -> worker), every batch named (taken, stale, dropped), whether it carries state."""
    from intellect_node.protocol.signing import open_envelope
    from intellect_node.protocol.steps import MAX_RECORD_BYTES, STEP_DOMAIN, StepRecord

    out = {}
    for path in sorted((trainer_dir / "trainer" / "records").glob("*.rec")):
        rec, _ = open_envelope(path.read_bytes(), STEP_DOMAIN, StepRecord, max_size=MAX_RECORD_BYTES)
        out[rec.seq] = {"base": rec.base_version, "version": rec.version,
                        "taken": {b.cid: b.worker for b in rec.batches},
                        "named": {b.cid for b in (*rec.batches, *rec.stale)} | {d.cid for d in rec.dropped},
                        "state": rec.state is not None}
    return out


@dataclass
class Swarm:
    """The nodes :func:`start_swarm` started, each ready, and the two addresses others bootstrap from."""

    trainer: NodeProcess
    validator: NodeProcess
    workers: dict[str, NodeProcess]
    t_addr: str
    v_addr: str

    @property
    def nodes(self) -> list[NodeProcess]:
        return [self.trainer, self.validator, *self.workers.values()]


def start_swarm(run: RoleRun, mode: str | None = None, *, workers: Sequence[str] = ("w1",),
                cheats: Sequence[str] = ()) -> Swarm:
    """``run``'s trainer (honest, or ``tests/support/dishonest_trainer.py`` ``mode``), its validator
    ``root/validator``, honest ``workers`` and reward-cheating ``cheats`` (``roles.py`` ``reward``), all
    started at once so that their start-ups (torch, the model) overlap. The trainer and the validator
    listen on ports picked beforehand (``ports.reserved_port``) and bootstrap to each other, the workers
    to both. A node dials its bootstrap peers again only while no peer at all is connected
    (``BOOTSTRAP_RETRY_S`` in ``node/runtime.py``), so whichever of the two comes up last is the one that
    connects them; a worker may reach only one of them, which is enough: gossip goes through it, and
    blobs are fetched over HTTP from the URL in the holder's heartbeats. Returns once every node is
    ready."""
    port_t, port_v = reserved_port(), reserved_port()
    while port_v == port_t:
        port_v = reserved_port()
    t_addr = f"/ip4/127.0.0.1/tcp/{port_t}/p2p/{run.ids['trainer']}"
    v_addr = f"/ip4/127.0.0.1/tcp/{port_v}/p2p/{run.ids['validator']}"
    if mode is None:
        trainer = run.start("trainer", "trainer", port=port_t, bootstrap=[v_addr])
    else:
        write_config(run.root / "trainer", **{**run.common, "port": port_t, "bootstrap": [v_addr]})
        trainer = NodeProcess(run.root / "trainer", env=ENV,
                              argv=[sys.executable, "-m", "tests.support.dishonest_trainer", mode,
                                    str(run.root / "trainer")])
        run.procs.append(trainer)
    validator = run.start("validator", "validator", bootstrap=[t_addr], port=port_v)
    started = {w: run.start(w, "worker", bootstrap=[t_addr, v_addr]) for w in workers}
    started.update({c: run.cheat(c, "reward", bootstrap=[t_addr, v_addr]) for c in cheats})
    sw = Swarm(trainer, validator, started, t_addr, v_addr)
    for proc in sw.nodes:
        listen_addr(proc)
    return sw


def shows_failed(proc: NodeProcess, seq: int) -> bool:
    """Whether the node's status shows the trainer failed the audit, its first failed step ``seq``."""
    a = audits_seen(proc)
    return a["state"] == "failed" and (a["first_failed"] or {}).get("seq") == seq

