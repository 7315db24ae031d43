"""Chaos with real processes: a trainer, a validator and two workers (``intellect-node join --role``),
nodes of every role SIGKILLed and restarted (seeded moments: the trainer alone, then the validator and a
worker at once), then a network partition for a while.

Each node runs in its own network namespace on a shared bridge (``testing.netns.Topology``), listening on
a fixed port, so all four start at once with each other's addresses and a restarted node keeps its
address: the one launcher, ``node.processes.NodeProcess`` (``netns=``), starts each, restarts it with the
same command on the same data dir and ends it by PID. The partition is iptables DROP rules inside those
namespaces between {trainer, worker 1} and {validator, worker 2} (silent loss, no resets, like a cable
pulled), lifted once both sides have declared the other gone. Without namespaces (not root, not Linux)
the nodes run on 127.0.0.1 and only the partition test is skipped, saying why.

What is checked, after the kills and again after the partition:
- no accepted rollout is lost: every batch the trainer acknowledged (persisted to ``trainer/inbox``
  after its validators accepted it, as watched by a poller, or listed in ``metrics.jsonl``) is in the
  latest checkpoint's consumed set or still in the inbox; the consumed set never shrinks; no batch is
  trained on twice;
- the trainer goes on from its checkpoint: after each kill it resumes at the checkpointed version and
  its next trained version is that plus one; trained versions only increase;
- every node reconverges: each sees the three others alive (heartbeats), the connections link all four,
  the trainer trains again, and every node has heard the trainer's newest policy and holds one within
  ``async_level`` of it; no node has banned another (all of them are honest).

Seed: ``CHAOS_SEED`` (default 7), printed with the schedule so a failure can be replayed. Two rounds, not
one per node: each restart costs a process start (torch, libp2p, the model), and what a kill can break is
per role (the trainer's checkpoint and inbox, the validator's verdicts, a worker's batches in flight), so
one kill of each role, the trainer's alone and two nodes at once, covers it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from intellect_node.errors import IntellectNodeError
from intellect_node.fsutil import read_jsonl
from intellect_node.node.processes import stop_all
from intellect_node.testing.netns import Topology, netns_unavailable_reason
from tests.support.ports import free_port
from tests.support.roles import ENV, make_key, write_config
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]
SEED = int(os.environ.get("CHAOS_SEED", "7"))
RL = dict(group_size=8, problems_per_batch=4, groups_per_step=4, max_new_tokens=5, lr=2e-4,
          batches_per_version=2)
"""A step is one worker batch (``groups_per_step`` = ``problems_per_batch``): each trained step costs one
batch's notices, fetches and verdicts."""
ASYNC_LEVEL = 2
NAMES = ("trainer", "validator", "w1", "w2")
ROLES = {"trainer": "trainer", "validator": "validator", "w1": "worker", "w2": "worker"}
SIDES = ({"trainer", "w1"}, {"validator", "w2"})
"""The partition: the trainer keeps a worker, the validator the other one."""
PORT = 4001
START_S = 240.0
"""Bound on a node's start (torch + libp2p imports, model load) on a loaded 2-core machine."""
PROGRESS_S = 300.0
"""Bound on the next trained steps after a disturbance (nodes must find each other again first)."""
STOP_S = 40.0
"""Bound on the nodes' clean stop at the end (SIGTERM to all at once, then SIGKILL)."""
PEER_TIMEOUT = 6.0
"""``network.peer_timeout`` of every node (heartbeats every second): the partition's sides see each
other gone this long after it starts."""


class Acks:
    """Watches the trainer's acknowledgements: inbox entries and checkpoints, from a polling thread."""

    def __init__(self, trainer_dir: Path) -> None:
        self.dir = trainer_dir / "trainer"
        self.acknowledged: set[str] = set()
        self.consumed: frozenset[str] = frozenset()
        self.checkpoint = -1
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> "Acks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def inbox(self) -> set[str]:
        try:
            return {p.name[:-5] for p in (self.dir / "inbox").glob("*.json")}
        except OSError:
            return set()

    def latest(self) -> tuple[int, frozenset[str]] | None:
        try:
            name = (self.dir / "checkpoints" / "LATEST").read_text().strip()
            meta = json.loads((self.dir / "checkpoints" / name / "state.json").read_text())
            return int(meta["version"]), frozenset(meta["consumed"])
        except (OSError, ValueError, KeyError):
            return None  # not written yet, or pruned between the two reads: the next poll sees it

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.poll()

    def poll(self) -> None:
        seen = self.inbox()
        latest = self.latest()
        with self._lock:
            self.acknowledged |= seen
            if latest is not None:
                version, consumed = latest
                if version < self.checkpoint or not self.consumed <= consumed:
                    self.problems.append(f"checkpoint went back: v{self.checkpoint} -> v{version}, "
                                         f"{len(self.consumed - consumed)} consumed batches forgotten")
                self.checkpoint, self.consumed = max(version, self.checkpoint), consumed | self.consumed

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / "metrics.jsonl")  # a line being appended: skipped

    def trained(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics() if m["trained"]]

    def check_nothing_lost(self) -> None:
        """Every acknowledged batch is consumed or still queued in the inbox; none trained twice."""
        with self._lock:
            acked = set(self.acknowledged)
        for m in self.metrics():
            acked |= set(m["batches"])
        # Inbox first, then the checkpoint: an entry leaves the inbox only after the checkpoint that
        # consumed it is committed, so a batch missing from both really is lost.
        inbox = self.inbox()
        latest = self.latest()
        assert latest is not None
        lost = acked - inbox - latest[1]
        assert not lost, (f"{len(lost)} acknowledged batches neither consumed nor in the inbox: "
                          f"{sorted(lost)[:5]}")
        assert not self.problems, self.problems
        seen: set[str] = set()
        versions = []
        for m in self.trained():
            twice = seen & set(m["batches"])
            assert not twice, f"trained twice: {sorted(twice)}"
            seen |= set(m["batches"])
            versions.append(m["version"])
        assert versions == sorted(set(versions)), versions
        print(f"acknowledged {len(acked)} batches: {len(latest[1])} consumed by v{latest[0]}, "
              f"{len(inbox)} queued")


class Swarm:
    """The four nodes, each in ``root/<name>`` with a key made beforehand and a fixed listen address, so
    every node can be started at once with the others' addresses and a restarted node keeps its own.
    Started, restarted and ended (by PID) by the one launcher, ``node.processes.NodeProcess``."""

    def __init__(self, root: Path, topo: Topology | None) -> None:
        from intellect_node.models.loader import embedded_model_dir

        self.root, self.topo = root, topo
        self.ids = {name: make_key(root / name) for name in NAMES}
        self.ns: dict[str, str | None] = {}
        self.ips: dict[str, str] = {}
        self.listen: dict[str, str] = {}
        for i, name in enumerate(NAMES):
            if topo is not None:
                self.ns[name], self.ips[name], port = topo.public_ns[i], topo.public_ip(i), PORT
            else:
                self.ns[name], self.ips[name], port = None, "127.0.0.1", free_port()
            self.listen[name] = f"/ip4/{self.ips[name]}/tcp/{port}"
        for name in NAMES:
            write_config(root / name, trainer=self.ids["trainer"], validators=[self.ids["validator"]],
                         model=str(embedded_model_dir()), rl=RL, run_id="chaos", async_level=ASYNC_LEVEL)
        self.nodes: dict[str, NodeProcess] = {}
        self.restarted: set[str] = set()
        self.acks = Acks(root / "trainer")

    def start(self) -> None:
        """Start all four at once, each dialing the three others (a node that reaches none of them yet
        dials again: the runtime's bootstrap retries), and wait until each answers."""
        for name in NAMES:
            args = ["--role", ROLES[name], "--listen", self.listen[name], "--http-host", self.ips[name],
                    "--peer-timeout", str(PEER_TIMEOUT)]
            for other in NAMES:
                if other != name:
                    args += ["--bootstrap", f"{self.listen[other]}/p2p/{self.ids[other]}"]
            self.nodes[name] = NodeProcess(self.root / name, *args, env=ENV, netns=self.ns[name])
        for name in NAMES:
            self.nodes[name].wait_ready(START_S)

    def status(self, name: str) -> dict[str, Any]:
        """``name``'s status ({} while it starts or restarts; AssertionError, with its log, if it died)."""
        node = self.nodes[name]
        if not node.alive():
            raise AssertionError(node.death_note())
        try:
            return node.status(timeout=10.0)
        except IntellectNodeError:
            return {}  # not up yet, or the control file a killed predecessor left

    def trained_steps(self) -> int:
        return len(self.acks.trained())

    def check_running(self) -> None:
        """Fail at once (with its log) if a node died on its own: only the test kills nodes."""
        for node in self.nodes.values():
            if not node.alive():
                raise AssertionError(node.death_note())

    def wait_trained(self, n: int, what: str) -> None:
        def enough() -> bool:
            self.check_running()
            return self.trained_steps() >= n
        wait_for(enough, timeout=PROGRESS_S, interval=0.5, what=f"{n} trained steps ({what})")

    def kill_and_restart(self, names: list[str]) -> None:
        trainer = self.nodes["trainer"]
        for name in names:
            self.nodes[name].signal(signal.SIGKILL)
            self.nodes[name].wait(30)
        if "trainer" in names:
            latest = self.acks.latest()
            assert latest is not None
            v_ckpt = latest[0]
            n_lines = len(self.acks.metrics())
            log_mark = trainer.log_path.stat().st_size
        for name in names:  # the same command: the same data dir, address and log
            self.nodes[name].restart()
            self.restarted.add(name)
        for name in names:
            self.nodes[name].wait_ready(START_S)
        if "trainer" in names:
            assert self.status("trainer")["trainer"]["version"] >= v_ckpt
            new_log = trainer.log_path.read_bytes()[log_mark:].decode(errors="replace")
            assert f"resumed at policy v{v_ckpt} " in new_log, new_log[-3000:]
            wait_for(lambda: any(m["trained"] for m in self.acks.metrics()[n_lines:]), timeout=PROGRESS_S,
                     interval=0.5, what="a trained step after the trainer's restart")
            # The trainer checkpoints every rl.checkpoint_every steps and replays the journaled steps
            # after it (roles/trainer/role.py): the first step it records is the one after the last it had
            # recorded, unless the replay could not reproduce the announced policy and bumped past it.
            before = [m["version"] for m in self.acks.metrics()[:n_lines] if m["trained"]]
            v_last = max(before, default=v_ckpt)
            first = next(m for m in self.acks.metrics()[n_lines:] if m["trained"])
            replay = self.status("trainer")["trainer"]["replay"]
            if replay["outcome"] == "bumped":
                assert first["version"] > v_last, (first["version"], v_last, replay)
            else:
                assert first["version"] == v_last + 1, (first["version"], v_last, v_ckpt, replay)

    def converged(self, min_steps: int) -> bool:
        """Each node sees the others alive, connections link all four, the trainer trained ``min_steps``
        in all, and every node heard its newest policy and holds one within ``async_level``."""
        self.check_running()
        st = {name: self.status(name) for name in NAMES}
        if not all(st.values()) or self.trained_steps() < min_steps:
            return False
        ids = self.ids
        links = {(name, p) for name, s in st.items() for p in s["peers"]}
        reach, frontier = {"trainer"}, ["trainer"]
        while frontier:
            a = frontier.pop()
            for b, pid in ids.items():
                if b not in reach and ((a, pid) in links or (b, ids[a]) in links):
                    reach.add(b)
                    frontier.append(b)
        if reach != set(NAMES):
            return False
        for name, s in st.items():
            if set(ids.values()) - {ids[name]} - set(s["alive_peers"]):
                return False
        tv = st["trainer"]["trainer"]["version"]
        for name in ("w1", "w2"):
            if st[name]["worker"]["policy_version"] < tv - ASYNC_LEVEL:
                return False
        held = st["validator"]["validator"]["versions_held"]
        if not held or max(held) < tv - ASYNC_LEVEL:
            return False
        return all(s["snapshot"]["policy"]["current"] >= tv - 1 for s in st.values())

    def wait_converged(self, min_steps: int, what: str) -> None:
        wait_for(lambda: self.converged(min_steps), timeout=PROGRESS_S, interval=1.0,
                 what=f"reconvergence ({what})")
        self.check_no_bans()

    def check_no_bans(self) -> None:
        """Every node here is honest: crashes and partitions may cost an honest peer a strike (a blob
        gone with a killed worker) but never a ban."""
        ids = {peer: name for name, peer in self.ids.items()}
        bans = [f"{name} banned {ids[rec['peer_id']]} ({rec['last_rejection']})"
                for name in NAMES for rec in self.status(name).get("known_peers", [])
                if rec["peer_id"] in ids and rec["banned"]]
        assert not bans, bans

    def partition(self, on: bool) -> None:
        """DROP every packet between the two sides, inside each node's namespace (both directions)."""
        assert self.topo is not None
        op = "-I" if on else "-D"
        for side, other in (SIDES, SIDES[::-1]):
            for name in side:
                ns = self.ns[name]
                assert ns is not None
                for peer in other:
                    ip = self.ips[peer]
                    for rule in (["INPUT", "-s", ip], ["OUTPUT", "-d", ip]):
                        r = subprocess.run(["ip", "netns", "exec", ns, "iptables", op, *rule, "-j", "DROP"],
                                           capture_output=True, text=True, timeout=30)
                        assert r.returncode == 0, r.stderr

    def close(self) -> None:
        stop_all(self.nodes.values(), grace=STOP_S)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    root = tmp_path_factory.mktemp("chaos")
    reason = netns_unavailable_reason()
    topo = Topology(n_public=len(NAMES), nats=(), log_dir=root) if reason is None else None
    if topo is not None:
        topo.__enter__()
    sw = Swarm(root, topo)
    sw.netns_reason = reason  # type: ignore[attr-defined]  # set on this swarm for the report
    try:
        with sw.acks:
            sw.start()
            yield sw
    finally:
        sw.close()
        if topo is not None:
            topo.close()


@pytest.mark.timeout(1500)
def test_random_sigkills_of_every_role_lose_no_accepted_rollout(swarm: Swarm) -> None:
    rng = random.Random(SEED)
    # Every role once: the trainer alone, then the validator and a worker at once. Each kill waits for
    # 1-2 more trained steps (the trainer's: journaled steps past its checkpoint, which its restart
    # replays) and then, at random (always for the trainer's own round), also for an accepted batch
    # sitting in the trainer's inbox (acknowledged, not yet in a checkpoint: what a crash must not lose).
    rounds = [["trainer"], ["validator", rng.choice(["w1", "w2"])]]
    plan = [(rng.randint(1, 2), "inbox" if r == ["trainer"] else rng.choice(["step", "inbox"]))
            for r in rounds]
    print(f"chaos seed {SEED}: kill rounds {rounds}, (trained steps, moment) before each {plan}")
    for victims, (wait, moment) in zip(rounds, plan):
        swarm.wait_trained(swarm.trained_steps() + wait, f"before killing {victims}")
        if moment == "inbox":
            def inbox_waiting() -> object:
                swarm.check_running()
                return swarm.acks.inbox()

            wait_for(inbox_waiting, timeout=PROGRESS_S, interval=0.05,
                     what="an accepted batch waiting in the trainer's inbox")
        swarm.kill_and_restart(victims)
        swarm.acks.poll()
        swarm.acks.check_nothing_lost()
    swarm.wait_converged(swarm.trained_steps() + 1, "after the kills")
    swarm.acks.check_nothing_lost()
    restarted = {ROLES[n] for n in swarm.restarted}
    assert restarted == set(ROLES.values()), restarted


@pytest.mark.timeout(900)
def test_partition_heals_and_every_node_reconverges(swarm: Swarm) -> None:
    reason = getattr(swarm, "netns_reason")
    if reason is not None:
        pytest.skip(f"the partition needs network namespaces: {reason}")
    swarm.wait_converged(max(1, swarm.trained_steps()), "before the partition")
    a, b = (sorted(s) for s in SIDES)
    swarm.partition(True)
    try:
        ids = swarm.ids

        def split() -> bool:
            # Both sides have declared the other gone (no heartbeat for peer_timeout).
            for side, other in ((a, b), (b, a)):
                for name in side:
                    alive = set(swarm.status(name).get("alive_peers", [ids[o] for o in other]))
                    if alive & {ids[o] for o in other}:
                        return False
            return True
        wait_for(split, timeout=120, interval=0.5, what=f"{a} and {b} to see each other gone")
        steps_split = swarm.trained_steps()
    finally:
        swarm.partition(False)
    print(f"partitioned {a} | {b}; {steps_split} trained steps when healed")
    swarm.wait_converged(steps_split + 1, "after the partition")  # a step on verdicts made after it
    swarm.acks.poll()
    swarm.acks.check_nothing_lost()
