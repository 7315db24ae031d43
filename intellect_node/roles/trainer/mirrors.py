"""The trainer's metrics copied to the tools researchers use: W&B and TensorBoard (``[logging]``).

What goes out:

1. each trained step's metrics line (``metrics.py``, the dict ``Trainer._record`` builds) as scalars
   named ``train/<key>`` at the step's number: its numbers (a bool as 0 or 1), nested dicts flattened
   with "/" (``train/published/publish_s``). Left out: ``step`` (the x axis), ``seq`` (a journal number),
   the wall-clock times (``time``, ``*_t``: both tools stamp each point themselves) and the per-batch
   keys (``batches``, ``hops``: a new name for every batch). The line of an attempt that trained nothing
   (no learnable group) is not mirrored: it carries the previous step's number, and W&B would write its
   zeros over that step's figures (``metrics.jsonl`` and the status board count those attempts);
2. held-out results (:meth:`Mirrors.log_heldout`, for an evaluator of policy versions) as
   ``heldout/<key>`` at the policy version: TensorBoard's step is the version, and W&B plots them
   against ``heldout/version``.

How: one thread (``metrics-mirrors``) owns the sinks. It opens them (importing wandb and starting its run
takes about 2 s), writes each line the event loop queued, and closes them when the trainer stops; the
event loop only flattens a dict and queues it. A sink that raises is turned off
for the rest of the process with one WARNING naming it and the error, and shown in
:meth:`Mirrors.status`: training and the other sink go on. While a sink is stuck, lines past
:data:`MAX_QUEUED` are dropped (one WARNING) and counted.

Shortcuts: a restarted trainer starts a new W&B run (the same name, steps numbered on from the
checkpoint), and appends a new event file to the same TensorBoard folder. W&B's service process writes
the run's file out just after ``finish()`` returns; wandb's exit hook waits for it when the node exits.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, TypedDict, TypeVar

from intellect_node.config import NodeConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_QUEUED = 1000
"""Lines waiting for the sinks before new ones are dropped: about 10 minutes of 0.5 s steps, so only a
sink that hangs loses any."""
CLOSE_TIMEOUT_S = 30.0
"""How long stopping the trainer waits for the sinks to write what is queued and close (W&B finishing an
offline run takes well under a second)."""
LEFT_OUT = frozenset({"step", "seq", "batches", "hops"})
"""Top-level keys of a metrics line that are not mirrored (see the module docstring)."""


def numeric_fields(line: Mapping[str, object], prefix: str = "") -> dict[str, float]:
    """The numbers of ``line`` by name, nested dicts flattened with "/", bools as 0/1; the keys of
    :data:`LEFT_OUT` (at the top) and wall-clock times (``time``, ``*_t``) left out."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if (not prefix and key in LEFT_OUT) or key == "time" or key.endswith("_t"):
            continue
        name = prefix + key
        if isinstance(value, Mapping):
            out.update(numeric_fields(value, name + "/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


class MirrorsStatus(TypedDict):
    """The mirrors in a trainer's status: the sinks writing, those turned off (with why), lines written
    and lines dropped while the sinks fell behind."""

    sinks: list[str]
    failed: dict[str, str]
    written: int
    dropped: int


class MetricsMirror(Protocol):
    """One sink. Its methods run on the mirrors' thread, one at a time; any may raise (the sink is then
    turned off)."""

    def train(self, step: int, fields: Mapping[str, float]) -> None:
        """Write one step's fields (unprefixed: ``loss``, ``published/publish_s``)."""

    def heldout(self, version: int, fields: Mapping[str, float]) -> None:
        """Write the held-out results of policy ``version``."""

    def close(self) -> None:
        """Write out what is buffered and release the files (or the W&B run)."""


class WandbMirror:
    """A W&B run (``wandb.init``): offline, it writes ``<directory>/wandb/offline-run-*/`` and never
    uses the network. Quiet: no console capture, no banner, no code or git snapshot."""

    name = "wandb"

    def __init__(self, *, project: str, mode: Literal["offline", "online"], directory: Path, run_name: str,
                 config: Mapping[str, object]) -> None:
        import wandb  # the logging extra, imported only when configured

        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_code=True,
                                  disable_git=True)
        # create_new: two trainers in one process (the in-process tests) get a run each
        self.run = wandb.init(project=project, mode=mode, dir=str(directory), name=run_name,
                              config=dict(config), settings=settings, reinit="create_new")
        self.run.define_metric("heldout/version")
        self.run.define_metric("heldout/*", step_metric="heldout/version")
        self._step = 0

    def train(self, step: int, fields: Mapping[str, float]) -> None:
        self.run.log({f"train/{k}": v for k, v in fields.items()}, step=step)
        self._step = max(self._step, step)

    def heldout(self, version: int, fields: Mapping[str, float]) -> None:
        # W&B's own step only grows: held-out points join the newest step's row, their x axis is the version
        self.run.log({"heldout/version": version, **{f"heldout/{k}": v for k, v in fields.items()}},
                     step=self._step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardMirror:
    """TensorBoard event files in ``directory`` (``torch.utils.tensorboard.SummaryWriter``), flushed after
    every write so a running ``tensorboard --logdir`` shows each step as it comes."""

    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (logging extra)

        self.writer = SummaryWriter(log_dir=str(directory))

    def train(self, step: int, fields: Mapping[str, float]) -> None:
        for key, value in fields.items():
            self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()

    def heldout(self, version: int, fields: Mapping[str, float]) -> None:
        for key, value in fields.items():
            self.writer.add_scalar(f"heldout/{key}", value, version)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


Opener = tuple[str, Callable[[], MetricsMirror]]
"""A sink's name and how to open it (on the mirrors' thread)."""
_Item = tuple[str, int, dict[str, float]]  # ("train" | "heldout", step or version, fields)


def mirror_openers(cfg: NodeConfig, trainer_dir: Path) -> list[Opener]:
    """The sinks ``cfg.logging`` turns on, with their folders (defaults under ``trainer_dir``)."""
    lc = cfg.logging
    out: list[Opener] = []
    if lc.wandb:
        wandb_dir = Path(lc.wandb_dir).expanduser() if lc.wandb_dir else trainer_dir
        settings = {"run": cfg.run.model_dump(mode="json"), "rl": cfg.rl.model_dump(mode="json")}
        out.append((WandbMirror.name, lambda: WandbMirror(project=lc.wandb_project, mode=lc.wandb_mode,
                                                 directory=wandb_dir, run_name=cfg.run.run_id,
                                                 config=settings)))
    if lc.tensorboard:
        tb_dir = Path(lc.tensorboard_dir).expanduser() if lc.tensorboard_dir else trainer_dir / "tensorboard"
        out.append((TensorBoardMirror.name, lambda: TensorBoardMirror(tb_dir)))
    return out


class Mirrors:
    """The configured sinks behind one queue and the thread that writes to them (module docstring)."""

    def __init__(self, openers: Sequence[Opener]) -> None:
        self._openers = list(openers)
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None  # start() makes it, when there is a sink
        self._live: list[tuple[str, MetricsMirror]] = []  # the thread's own: sinks opened, not failed
        self.failed: dict[str, str] = {}
        """Sink name -> the error that turned it off."""
        self.written = 0
        """Lines (steps and held-out results) handed to the live sinks."""
        self.dropped = 0
        """Lines dropped because :data:`MAX_QUEUED` were waiting."""

    def start(self) -> None:
        """Open the sinks on the mirrors' thread; lines queued meanwhile wait for them."""
        if self._openers and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrics-mirrors", daemon=True)
            self._thread.start()

    def step(self, line: Mapping[str, object]) -> None:
        """Queue a step's metrics line (a :class:`~intellect_node.roles.trainer.metrics.StepLine`; never
        blocks; nothing to do when no sink is configured, or when the attempt trained nothing)."""
        step = line.get("step")
        if line.get("trained") and isinstance(step, int):
            self._put(("train", step, numeric_fields(line)))

    def log_heldout(self, version: int, fields: Mapping[str, object]) -> None:
        """Queue the held-out results of policy ``version`` (``pass_rate``, ``mean_reward``, ``n``...)."""
        self._put(("heldout", version, {k: v for k, v in numeric_fields(fields).items() if k != "version"}))

    def close(self) -> None:
        """Write what is queued, close the sinks and end the thread (blocking: call it off the event loop).
        Waits at most :data:`CLOSE_TIMEOUT_S`."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(CLOSE_TIMEOUT_S)
        if thread.is_alive():
            log.warning("metrics mirrors did not finish within %.0f s; their last lines may be missing",
                        CLOSE_TIMEOUT_S)

    def status(self) -> MirrorsStatus:
        return {"sinks": [name for name, _ in self._openers if name not in self.failed],
                "failed": dict(self.failed), "written": self.written, "dropped": self.dropped}

    def _put(self, item: _Item) -> None:
        if self._thread is None:
            return
        if self._queue.qsize() >= MAX_QUEUED:
            if not self.dropped:
                log.warning("%d metrics lines wait for the mirrors (%s): new ones are dropped until they "
                            "catch up; training goes on", MAX_QUEUED, ", ".join(self.status()["sinks"]))
            self.dropped += 1
            return
        self._queue.put(item)

    def _run(self) -> None:
        for name, open_sink in self._openers:
            sink = self._call(name, open_sink)
            if sink is not None:
                self._live.append((name, sink))
        while (item := self._queue.get()) is not None:
            kind, at, fields = item
            for name, sink in self._live:
                self._call(name, sink.train if kind == "train" else sink.heldout, at, fields)
            self._live = [(name, sink) for name, sink in self._live if name not in self.failed]
            if self._live:
                self.written += 1
        for name, sink in self._live:
            self._call(name, sink.close)

    def _call(self, name: str, fn: Callable[..., T], *args: object) -> T | None:
        """One call into sink ``name``; None when it raised, which turns the sink off. Broad on purpose:
        this is the edge of third-party code (wandb, tensorboard) that must never stop training,
        whatever it raises."""
        try:
            return fn(*args)
        except Exception as exc:
            self.failed[name] = f"{type(exc).__name__}: {exc}"
            log.warning("the %s metrics mirror (logging.%s) failed and is off until the trainer restarts "
                        "(%s); training goes on", name, name, self.failed[name])
            return None
