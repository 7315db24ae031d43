"""RL-role test helpers: node configs with pre-made keys, role processes, and cheating workers.

Honest nodes run the real CLI (``intellect-node join --role ...``). A cheating worker runs
``python -m tests.support.roles cheat MODE --data-dir D`` : the real node runtime and worker role with
:meth:`Worker.make_records` overridden, so its batches go out through the same blob store, notices and
signatures as an honest worker's. Cheating code lives here, not in the product.

Modes:
- ``reward``: claims reward 1.0 for every rollout (inflated reward);
- ``tokens``: replaces one completion token per rollout, re-signs the record (edited tokens);
- ``model``: generates with different weights (another model) while naming the announced policy;
- ``mix``: the three in turn, one per batch;
- ``replay``: honest batches, each followed by two more notices of the same rollouts under other blob
  names: the same bytes, then the same records with the groups in reverse order (other bytes);
- ``replay-first``: honest batches, each (from the second on) followed by the first batch's bytes under
  a new blob name;
- ``choose``: batches of problems it picks itself (the easiest sums, 000+000, 000+001, ...), generated
  honestly otherwise (derived seeds, real proofs), in place of its assignment;
- ``skip``: its assignment windows 1, 3, 5, ... of each version (it drops every other window).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intellect_node.fsutil import read_jsonl
from intellect_node.inference.base import InferenceEngine
from intellect_node.node.processes import write_config as write_config_file
from intellect_node.trainer.checkpoint import latest_dir, read_state
from tests.support.common import REPO
from tests.support.ports import reserved_port
from tests.support.swarm import NodeProcess

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def make_key(data_dir: Path) -> str:
    from intellect_node.p2p.identity import init_key

    data_dir.mkdir(parents=True, exist_ok=True)
    return init_key(data_dir).peer_id


def write_config(data_dir: Path, *, trainer: str, validators: list[str], model: str, rl: dict[str, Any],
                 run_id: str = "e2e", bootstrap: list[str] | None = None, async_level: int = 2,
                 verdict_quorum: int = 1, worker_allowlist: list[str] | None = None,
                 validator: dict[str, Any] | None = None, require_audits: bool = False,
                 auditors: list[str] | None = None, port: int = 0) -> Path:
    """``<data_dir>/config.toml`` (read by ``join`` from the data dir). ``validator``: the
    ``[validator]`` section's settings; ``require_audits``: ``run.require_audits``; ``auditors``:
    ``run.auditor_peer_ids``; ``port``: the libp2p port on 127.0.0.1 (0: the kernel's pick)."""
    network: dict[str, Any] = {"listen": [f"/ip4/127.0.0.1/tcp/{port}"], "http_host": "127.0.0.1",
                               "heartbeat_interval": 1.0, "peer_timeout": 10.0}
    if bootstrap:
        network["bootstrap"] = bootstrap
    run = {"run_id": run_id, "trainer_peer_id": trainer, "validator_peer_ids": validators, "model": model,
           "async_level": async_level, "verdict_quorum": verdict_quorum,
           "worker_allowlist": worker_allowlist or [], "require_audits": require_audits,
           "auditor_peer_ids": auditors or []}
    return write_config_file(data_dir / "config.toml", {"network": network, "metrics": {"enabled": False},
                                                        "run": run, "rl": rl, "validator": validator or {}})


def role_process(data_dir: Path, role: str) -> NodeProcess:
    return NodeProcess(data_dir, "--role", role, env=ENV)


def start_role(data_dir: Path, role: str, procs: list[Any], **config: Any) -> NodeProcess:
    """Write ``data_dir``'s config (``write_config`` keywords), start the node as ``role`` and add it to
    ``procs``, which the caller closes."""
    write_config(data_dir, **config)
    proc = role_process(data_dir, role)
    procs.append(proc)
    return proc


def listen_addr(proc: NodeProcess, timeout: float = 180) -> str:
    """The node's first listen address, once it is ready (what others bootstrap from)."""
    return str(proc.wait_ready(timeout)["listen_addrs"][0])


@dataclass
class RoleRun:
    """One run's nodes, each in its data dir ``root/<name>``: their peer IDs (``ids``), the config every
    node of the run shares (``common``: ``write_config`` keywords) and the processes started (``procs``),
    which :func:`role_run` closes."""

    root: Path
    ids: dict[str, str]
    common: dict[str, Any]
    procs: list[NodeProcess] = field(default_factory=list)

    def start(self, name: str, role: str, **config: Any) -> NodeProcess:
        """``root/name`` started as ``role`` with the run's config, ``config`` (e.g. ``bootstrap``) on top."""
        return start_role(self.root / name, role, self.procs, **{**self.common, **config})

    def trainer_and_validator(self, trainer: NodeProcess | None = None, validator: str = "validator",
                              ) -> tuple[NodeProcess, str, NodeProcess, str]:
        """The run's trainer in ``root/trainer`` (``trainer``: one the caller started there, with a config or
        a program of its own), then a validator in ``root/<validator>`` bootstrapped to it, each ready:
        ``(trainer, its address, validator, its address)``; workers bootstrap to both."""
        if trainer is None:
            trainer = self.start("trainer", "trainer")
        elif trainer not in self.procs:
            self.procs.append(trainer)
        t_addr = listen_addr(trainer)
        proc = self.start(validator, "validator", bootstrap=[t_addr])
        return trainer, t_addr, proc, listen_addr(proc)

    def trainer_and_validator_at_once(self, validator: str = "validator",
                                      ) -> tuple[NodeProcess, str, NodeProcess, str]:
        """The run's trainer in ``root/trainer`` and a validator in ``root/<validator>`` started together,
        not waited for: ``(trainer, its address, validator, its address)``. Each listens on a port picked
        beforehand (``ports.reserved_port``) and bootstraps to the other, so the workers started next can
        name both at once and every start-up (torch, libp2p, the model) overlaps the others. A node dials
        its bootstrap peers again while no peer is connected (``BOOTSTRAP_RETRY_S`` in
        ``node/runtime.py``): whichever comes up last connects them."""
        port_t = reserved_port()
        port_v = reserved_port()
        while port_v == port_t:
            port_v = reserved_port()
        t_addr = f"/ip4/127.0.0.1/tcp/{port_t}/p2p/{self.ids['trainer']}"
        v_addr = f"/ip4/127.0.0.1/tcp/{port_v}/p2p/{self.ids[validator]}"
        trainer = self.start("trainer", "trainer", port=port_t, bootstrap=[v_addr])
        proc = self.start(validator, "validator", port=port_v, bootstrap=[t_addr])
        return trainer, t_addr, proc, v_addr

    def wait_ready(self, timeout: float = 180) -> None:
        """Every process started so far up (each still running: a test failure, with the log, if one exits
        first); call it once the run's first nodes are all launched."""
        for proc in self.procs:
            proc.wait_ready(timeout)

    def cheat(self, name: str, mode: str, **config: Any) -> "CheatProcess":
        """``root/name`` started as a cheating worker (``mode``: see the module docstring)."""
        write_config(self.root / name, **{**self.common, **config})
        proc = CheatProcess(self.root / name, mode)
        self.procs.append(proc)
        return proc

    def hostile(self, name: str, mode: str, **config: Any) -> "CheatProcess":
        """``root/name`` started as a ``tests.support.hostile`` peer (:func:`hostile_process`)."""
        return hostile_process(self.root / name, mode, self.procs, **{**self.common, **config})


@contextmanager
def role_run(root: Path, names: Iterable[str], *, rl: dict[str, Any],
             validators: Sequence[str] = ("validator",), allowlist: Sequence[str] = (),
             auditors: Sequence[str] = (), model: str | None = None, **config: Any) -> Iterator[RoleRun]:
    """A run of the nodes ``names`` under ``root``: a key each, ``trainer`` the run's trainer,
    ``validators`` its validators, ``auditors`` its auditors besides them (``run.auditor_peer_ids``) and
    ``allowlist`` its closed worker allowlist (none: an open run), the
    embedded model unless ``model``; ``config``: more ``write_config`` keywords every node shares. Every
    process started through it is closed on the way out."""
    from intellect_node.models.loader import embedded_model_dir

    ids = {n: make_key(root / n) for n in names}
    common = dict(trainer=ids["trainer"], validators=[ids[v] for v in validators],
                  worker_allowlist=[ids[w] for w in allowlist], auditors=[ids[a] for a in auditors],
                  model=model or str(embedded_model_dir()),
                  rl=rl, **config)
    run = RoleRun(root, ids, common)
    try:
        yield run
    finally:
        for p in run.procs:
            p.close()


class CheatProcess(NodeProcess):
    """A cheating worker as a child process (same control API as an honest node). ``module``: the test
    module whose ``__main__`` runs it (``tests.support.hostile`` for the other hostile peers)."""

    def __init__(self, data_dir: Path, mode: str, module: str = "tests.support.roles") -> None:
        argv = ["cheat", mode, str(data_dir)] if module == "tests.support.roles" else [mode, str(data_dir)]
        super().__init__(data_dir, env=ENV, argv=[sys.executable, "-m", module, *argv])


def hostile_process(data_dir: Path, mode: str, procs: list[Any], **config: Any) -> CheatProcess:
    """Write ``data_dir``'s config and start a ``tests.support.hostile`` peer (``flood``, ``tarpit``,
    ``stamp``, ``stamp-outsider``) added to ``procs``."""
    write_config(data_dir, **config)
    proc = CheatProcess(data_dir, mode, module="tests.support.hostile")
    procs.append(proc)
    return proc


def run_custom_node(data_dir: Path, label: str, services: list[Any], *, common: bool = True) -> int:
    """Run a node from ``data_dir``'s config as ``join`` would (JSON log lines), labelled ``label`` in its
    heartbeats, with ``services`` (factories of a runtime) in place of its RL role: a test's cheating or
    observed role in a child process. ``common``: the common services (blob service, ledger) too."""
    from intellect_node.commands.join import build_node_config
    from intellect_node.logsetup import setup_logging
    from intellect_node.node.assembly import build_node
    from intellect_node.node.runtime import run_node

    setup_logging(level="INFO", json_lines=True, file=None)
    cfg = build_node_config(listen=[], bootstrap=[], run_id=None, trainer_peer_id=None, http_host=None,
                            http_port=None, http_public_url=None, control_port=None, heartbeat_interval=None,
                            peer_timeout=None, data_dir=data_dir)
    return run_node(build_node(cfg, data_dir, labels=[label], services=services, common=common))


def cheater(mode: str) -> type[Any]:
    """The cheating worker role of ``mode`` (see the module docstring): the real :class:`Worker` with
    :meth:`Worker.make_records` (and for some modes ``submit`` or ``assigned``) overridden. Its
    ``for_runtime`` runs it in a child process (``cheat``) or in an in-process swarm
    (``intellect_node.testing.roles``) alike."""
    import dataclasses

    import msgspec
    import torch

    from intellect_node.fsutil import atomic_write_bytes
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.protocol.rl import NOTICE_KIND, RolloutNotice, seal_notice
    from intellect_node.protocol.rollout import RolloutBatch, encode_batch, sign_rollout
    from intellect_node.protocol.topics import topic
    from intellect_node.roles.worker.role import Worker

    class Cheater(Worker):
        copies = 0
        first: Any = None
        copy_cids: list[str] = []

        def status(self) -> dict[str, Any]:
            return {**super().status(), "copies": self.copies, "copy_cids": list(self.copy_cids)}

        async def submit(self, records: Any, version: int, n_tokens: int) -> str:
            cid = await super().submit(records, version, n_tokens)
            if mode == "replay":
                g = self.rl.group_size
                groups = [records[i:i + g] for i in range(0, len(records), g)]
                await self._copy(records, version)
                await self._copy([r for grp in reversed(groups) for r in grp], version)
            elif mode == "replay-first":
                if self.first is None:
                    self.first = (records, version)
                else:
                    await self._copy(*self.first)
            return cid

        async def _copy(self, records: Any, version: int) -> None:
            """The records again, under a blob name of their own (so another CID), with a notice."""
            self.copies += 1
            data = encode_batch(RolloutBatch(run_id=self.run_id, policy_version=version, rollouts=records))
            path = self.dir / "outbox" / f"copy-{self.copies}.batch"
            await asyncio.to_thread(atomic_write_bytes, path, data)
            cid, _ = await self.blobs.put_file(path, name=f"copy-{self.copies}")
            self.copy_cids = [*self.copy_cids, cid]
            path.unlink(missing_ok=True)
            notice = RolloutNotice(run_id=self.run_id, batch_cid=cid, policy_version=version,
                                   n_rollouts=len(records), batch_bytes=len(data))
            await self.rt.swarm.publish(topic(self.run_id, NOTICE_KIND),
                                        seal_notice(self.rt.swarm.key, notice))

        def assigned(self, version: int, window: int) -> Any:
            if mode == "skip":
                return super().assigned(version, 2 * window + 1)
            return super().assigned(version, window)

        def make_records(self, engine: InferenceEngine, problems: Any, version: int, checkpoint: str) -> Any:
            how = mode
            if mode == "choose":
                g, per = self.rl.group_size, self.rl.problems_per_batch
                problems = [self.task.problem(self.batches * per + j) for j in range(per) for _ in range(g)]
            if mode == "mix":  # one of each, in turn
                self._turn = getattr(self, "_turn", -1) + 1
                how = ("reward", "tokens", "model")[self._turn % 3]
            if how == "model":
                # Another model: the announced policy's weights with noise (same architecture, so the
                # records look fine structurally and only the tensor checks can tell).
                if not hasattr(self, "_other"):
                    assert isinstance(engine, TorchEngine)
                    loaded = engine.loaded
                    gen = torch.Generator().manual_seed(1)
                    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                             for k, v in loaded.state.items()}
                    self._other = TorchEngine(dataclasses.replace(loaded, state=state))
                engine = self._other
            recs = super().make_records(engine, problems, version, checkpoint)
            key = self.rt.swarm.key
            if how == "reward":
                return [sign_rollout(msgspec.structs.replace(r, reward=1.0), key) for r in recs]
            if how == "tokens":
                out = []
                for r in recs:
                    toks = list(r.completion_tokens)
                    i = 0
                    toks[i] = self.tokenizer.encode("9")[0] if toks[i] != self.tokenizer.encode("9")[0] \
                        else self.tokenizer.encode("8")[0]
                    # Claim the reward the edited text earns, so only the proof checks can tell.
                    reward = self.task.get(r.problem_id).reward(self.tokenizer.decode(toks))
                    edited = msgspec.structs.replace(r, completion_tokens=toks, reward=reward)
                    out.append(sign_rollout(edited, key))
                return out
            return recs

    return Cheater


def _cheat_main(mode: str, data_dir: Path) -> int:
    # A worker node in every way but its role's code: the common services, then the cheating worker.
    return run_custom_node(data_dir, "worker", [cheater(mode).for_runtime])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "cheat":
        sys.exit(_cheat_main(sys.argv[2], Path(sys.argv[3])))
    sys.exit(f"usage: {sys.argv[0]} cheat reward|tokens|model|mix|replay|replay-first|choose|skip DATA_DIR")


def announcements(tmp: Path, workers: Sequence[str] = ("w1", "w2")) -> dict[int, set[str]]:
    """Every (version -> content hashes) the ``workers`` of a :func:`role_run` in ``tmp`` heard announced
    (their ``worker/hops.jsonl``; the last line of a killed process is skipped)."""
    out: dict[int, set[str]] = {}
    for w in workers:
        for h in read_jsonl(tmp / w / "worker" / "hops.jsonl"):
            version, digest = h.get("version"), h.get("hash")
            if h.get("event") == "announced" and isinstance(version, int) and isinstance(digest, str):
                out.setdefault(version, set()).add(digest)
    return out


def checkpoint_version(tmp: Path) -> int:
    """The version of the trainer's newest checkpoint in a :func:`role_run` in ``tmp`` (-1: none yet)."""
    path = latest_dir(tmp / "trainer" / "trainer" / "checkpoints")
    return -1 if path is None else read_state(path).version


def kill_window(tmp: Path, checkpoint_every: int) -> bool:
    """A version past the trainer's checkpoint has been announced and the next checkpoint is two steps
    away at least: a SIGKILL now lands between checkpoints, not on one."""
    newest = max(announcements(tmp), default=-1)
    ckpt = checkpoint_version(tmp)
    return ckpt >= 0 and newest > ckpt and newest - ckpt <= checkpoint_every - 3
