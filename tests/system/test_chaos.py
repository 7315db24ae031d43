"""Chaos with real processes: a trainer, a validator and two workers (``intellect-node join --role``),
nodes of every role SIGKILLed and restarted (seeded moments: the trainer alone, then the validator and a
worker at once), then a network partition for a while.

Each node runs in its own network namespace on a shared bridge (``testing.netns.Topology``), listening on
a fixed port, so a restarted node keeps its address; the partition is iptables DROP rules inside those
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

from intellect_node.fsutil import read_jsonl
from intellect_node.testing.netns import Topology, http_get_in, netns_unavailable_reason
from tests.support.common import CLI
from tests.support.ports import free_port
from tests.support.roles import ENV, make_key, write_config
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]
SEED = int(os.environ.get("CHAOS_SEED", "7"))
RL = dict(group_size=8, problems_per_batch=4, groups_per_step=8, max_new_tokens=5, lr=2e-4,
          batches_per_version=2)
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


class Node:
    """One role process, restartable on the same data dir and address; ended by PID."""

    def __init__(self, name: str, root: Path, ns: str | None, ip: str, port: int) -> None:
        self.name, self.ns, self.ip, self.port = name, ns, ip, port
        self.role = ROLES[name]
        self.data_dir = root / name
        self.peer_id = make_key(self.data_dir)
        self.addr = f"/ip4/{ip}/tcp/{port}/p2p/{self.peer_id}"
        self.log_path = root / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, bootstrap: list[str]) -> None:
        argv = [CLI, "join", "--data-dir", str(self.data_dir), "--headless", "--role", self.role,
                "--listen", f"/ip4/{self.ip}/tcp/{self.port}", "--http-host", self.ip]
        for b in bootstrap:
            argv += ["--bootstrap", b]
        if self.ns:  # `ip netns exec` execs: the PID is the node's own
            argv = ["ip", "netns", "exec", self.ns, *argv]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **ENV,
                                              "INTELLECT_NODE_METRICS__ENABLED": "false"})
        self.starts += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.kill()

    def status(self) -> dict[str, Any]:
        """The control API's status of the current process ({} while it starts; AssertionError if it
        died)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            ctl = json.loads((self.data_dir / "control.json").read_text())
            if ctl.get("pid") != self.proc.pid:
                return {}  # the file a killed predecessor left
            body = self._get(ctl["url"] + "/v1/status", {"Authorization": f"Bearer {ctl['token']}"})
            return dict(json.loads(body))
        except (OSError, ValueError, KeyError):
            return {}

    def _get(self, url: str, headers: dict[str, str]) -> bytes:
        if self.ns:
            return http_get_in(self.ns, url, headers, timeout=10.0)
        import urllib.request

        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10.0) as resp:
            return bytes(resp.read())

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


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
    def __init__(self, root: Path, topo: Topology | None) -> None:
        from intellect_node.models.loader import embedded_model_dir

        self.root, self.topo = root, topo
        self.nodes: dict[str, Node] = {}
        for i, name in enumerate(NAMES):
            if topo is not None:
                self.nodes[name] = Node(name, root, topo.public_ns[i], topo.public_ip(i), PORT)
            else:
                self.nodes[name] = Node(name, root, None, "127.0.0.1", free_port())
        ids = {n: node.peer_id for n, node in self.nodes.items()}
        for node in self.nodes.values():
            write_config(node.data_dir, trainer=ids["trainer"], validators=[ids["validator"]],
                         model=str(embedded_model_dir()), rl=RL, run_id="chaos", async_level=ASYNC_LEVEL)
        self.acks = Acks(self.nodes["trainer"].data_dir)

    def start(self, name: str) -> None:
        """(Re)start ``name``; it dials every other node (those down are retried by the runtime)."""
        node = self.nodes[name]
        node.start([n.addr for n in self.nodes.values() if n is not node])

    def wait_ready(self, name: str) -> dict[str, Any]:
        return dict(wait_for(self.nodes[name].status, timeout=START_S, interval=0.2, what=f"{name} up"))

    def trained_steps(self) -> int:
        return len(self.acks.trained())

    def check_running(self) -> None:
        """Fail at once (with its log) if a node died on its own: only the test kills nodes."""
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is not None:
                raise AssertionError(f"{node.name} exited with {node.proc.returncode}:\n{node.log_tail()}")

    def wait_trained(self, n: int, what: str) -> None:
        def enough() -> bool:
            self.check_running()
            return self.trained_steps() >= n
        wait_for(enough, timeout=PROGRESS_S, interval=0.5, what=f"{n} trained steps ({what})")

    def kill_and_restart(self, names: list[str]) -> None:
        trainer = self.nodes["trainer"]
        for name in names:
            self.nodes[name].kill()
        if "trainer" in names:
            latest = self.acks.latest()
            assert latest is not None
            v_ckpt = latest[0]
            n_lines = len(self.acks.metrics())
            log_mark = trainer.log_path.stat().st_size
        for name in names:
            self.start(name)
        for name in names:
            self.wait_ready(name)
        if "trainer" in names:
            assert self.nodes["trainer"].status()["trainer"]["version"] >= v_ckpt
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
            replay = self.nodes["trainer"].status()["trainer"]["replay"]
            if replay["outcome"] == "bumped":
                assert first["version"] > v_last, (first["version"], v_last, replay)
            else:
                assert first["version"] == v_last + 1, (first["version"], v_last, v_ckpt, replay)

    def converged(self, min_steps: int) -> bool:
        """Each node sees the others alive, connections link all four, the trainer trained ``min_steps``
        in all, and every node heard its newest policy and holds one within ``async_level``."""
        self.check_running()
        st = {name: node.status() for name, node in self.nodes.items()}
        if not all(st.values()) or self.trained_steps() < min_steps:
            return False
        ids = {name: node.peer_id for name, node in self.nodes.items()}
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
        ids = {node.peer_id: name for name, node in self.nodes.items()}
        bans = [f"{name} banned {ids[rec['peer_id']]} ({rec['last_rejection']})"
                for name, node in self.nodes.items() for rec in node.status().get("known_peers", [])
                if rec["peer_id"] in ids and rec["banned"]]
        assert not bans, bans

    def partition(self, on: bool) -> None:
        """DROP every packet between the two sides, inside each node's namespace (both directions)."""
        assert self.topo is not None
        op = "-I" if on else "-D"
        for side, other in (SIDES, SIDES[::-1]):
            for name in side:
                ns = self.nodes[name].ns
                assert ns is not None
                for peer in other:
                    ip = self.nodes[peer].ip
                    for rule in (["INPUT", "-s", ip], ["OUTPUT", "-d", ip]):
                        r = subprocess.run(["ip", "netns", "exec", ns, "iptables", op, *rule, "-j", "DROP"],
                                           capture_output=True, text=True, timeout=30)
                        assert r.returncode == 0, r.stderr

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()




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
            sw.start("trainer")
            sw.wait_ready("trainer")
            for name in NAMES[1:]:
                sw.start(name)
            for name in NAMES[1:]:
                sw.wait_ready(name)
            yield sw
    finally:
        sw.close()
        if topo is not None:
            topo.close()


@pytest.mark.timeout(1500)
def test_random_sigkills_of_every_role_lose_no_accepted_rollout(swarm: Swarm) -> None:
    rng = random.Random(SEED)
    # Every role once: the trainer alone, then the validator and a worker at once. Each kill waits for
    # 1-2 more trained steps and then, at random (always for the trainer's own round), also for an
    # accepted batch sitting in the trainer's inbox (acknowledged, not yet in a checkpoint: what a crash
    # must not lose).
    rounds = [["trainer"], ["validator", rng.choice(["w1", "w2"])]]
    plan = [(rng.randint(1, 2), "inbox" if r == ["trainer"] else rng.choice(["step", "inbox"]))
            for r in rounds]
    print(f"chaos seed {SEED}: kill rounds {rounds}, (trained steps, moment) before each {plan}")
    swarm.wait_trained(2, "before the first kill")
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
    swarm.wait_converged(swarm.trained_steps() + 2, "after the kills")
    swarm.acks.check_nothing_lost()
    restarted = {ROLES[n] for n in NAMES if swarm.nodes[n].starts >= 2}
    assert restarted == set(ROLES.values()), restarted


@pytest.mark.timeout(900)
def test_partition_heals_and_every_node_reconverges(swarm: Swarm) -> None:
    reason = getattr(swarm, "netns_reason")
    if reason is not None:
        pytest.skip(f"the partition needs network namespaces: {reason}")
    swarm.wait_converged(swarm.trained_steps() + 1, "before the partition")
    a, b = (sorted(s) for s in SIDES)
    swarm.partition(True)
    try:
        ids = {n: node.peer_id for n, node in swarm.nodes.items()}

        def split() -> bool:
            # Both sides have declared the other gone (no heartbeat for peer_timeout).
            for side, other in ((a, b), (b, a)):
                for name in side:
                    alive = set(swarm.nodes[name].status().get("alive_peers", [ids[o] for o in other]))
                    if alive & {ids[o] for o in other}:
                        return False
            return True
        wait_for(split, timeout=120, interval=0.5, what=f"{a} and {b} to see each other gone")
        steps_split = swarm.trained_steps()
    finally:
        swarm.partition(False)
    print(f"partitioned {a} | {b}; {steps_split} trained steps when healed")
    swarm.wait_converged(steps_split + 2, "after the partition")
    swarm.acks.poll()
    swarm.acks.check_nothing_lost()
