"""Crash-safe trainer checkpoints: weights, optimizer, policy version and the consumed rollout batches.

Layout under ``root``::

    v00000007/model.safetensors   the policy weights of version 7
    v00000007/optimizer.pt        AdamW state after the step that produced version 7
    v00000007/state.json          {"version": 7, "consumed": [...batch IDs...], "step": ..., "extra": {...}}
    LATEST                        "v00000007" (written atomically, last)

A checkpoint directory is filled under a temporary name, every file fsynced, renamed into place and the
parent fsynced; only then is ``LATEST`` replaced (``fsutil.atomic_write_text``). A SIGKILL at any
instant leaves ``LATEST`` naming a complete checkpoint, so a restarted trainer resumes with the same
version numbering. The consumed set is the IDs of every rollout batch whose samples went into *this*
version's weights: a batch accepted but not in it is trained again after a crash (never lost) and a
batch in it is skipped (never trained twice), because the set and the weights are committed together.

The weights file is the canonical policy format (:class:`~intellect_node.policy.weights.
PolicyWeights`, a valid safetensors file), so the policy publisher can map the committed checkpoint
instead of copying the model again. Weights and optimizer state are streamed to and from disk (one
tensor at a time; the optimizer file is memory-mapped when read): a multi-GB model is never held twice.
Checkpoints written before (plain safetensors) still load.

Shortcuts: the consumed set is stored in full (one ID per accepted batch of the run); old checkpoints
beyond ``keep`` are deleted after ``LATEST`` moves on.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.fsutil import atomic_replace_file, atomic_write_text, fsync_dir
from intellect_node.policy.weights import DTYPES, PolicyWeights, require_finite
from intellect_node.trainer.optim import Optimizer

LATEST = "LATEST"
_FORMAT = 1


@dataclass(frozen=True)
class TrainerState:
    version: int
    consumed: frozenset[str] = frozenset()
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _dir_name(version: int) -> str:
    return f"v{version:08d}"


def save_checkpoint(root: str | os.PathLike[str], model: torch.nn.Module, optimizer: Optimizer | None,
                    state: TrainerState, *, keep: int = 2) -> Path:
    """Write checkpoint ``state.version`` atomically and point ``LATEST`` at it."""
    return save_checkpoint_state(root, model.state_dict(),
                                 optimizer.state_dict() if optimizer is not None else None, state, keep=keep)


def save_checkpoint_state(root: str | os.PathLike[str], weights: Mapping[str, torch.Tensor],
                          optimizer_state: dict[str, Any] | None, state: TrainerState, *,
                          keep: int = 2) -> Path:
    """:func:`save_checkpoint` from the state dicts themselves (what a sharded trainer gathers)."""
    require_finite(weights)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _dir_name(state.version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    PolicyWeights.write(tmp / "model.safetensors", weights)
    if optimizer_state is not None:
        part = tmp / ".optimizer.pt.part"
        with open(part, "wb") as f:
            torch.save(optimizer_state, f)  # streamed into the file, not built in a buffer first
        atomic_replace_file(part, tmp / "optimizer.pt")
    meta = {"format": _FORMAT, "version": state.version, "consumed": sorted(state.consumed),
            "step": state.step, "extra": state.extra}
    atomic_write_text(tmp / "state.json", json.dumps(meta, sort_keys=True))
    if final.exists():
        # A previous run died between the rename and LATEST: that directory was never current.
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, final.name + "\n")
    _prune(root, keep, current=final.name)
    return final


def _prune(root: Path, keep: int, current: str) -> None:
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit())
    for p in dirs[:-keep] if keep > 0 else []:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(".v") and ".tmp-" in p.name and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def latest_dir(root: str | os.PathLike[str]) -> Path | None:
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    if not (name.startswith("v") and name[1:].isdigit() and path.is_dir()):
        raise IntegrityError(f"{root / LATEST} names {name!r}, which is not a checkpoint directory")
    return path


def read_state(path: Path) -> TrainerState:
    try:
        meta = json.loads((path / "state.json").read_text())
        return TrainerState(version=int(meta["version"]),
                            consumed=frozenset(str(x) for x in meta["consumed"]),
                            step=int(meta["step"]), extra=dict(meta.get("extra", {})))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"checkpoint {path} has no readable state.json: {exc}") from exc


def _mapped_tensors(path: Path) -> tuple[mmap.mmap, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """A safetensors file mapped read-only and its table: name -> (dtype, shape, begin, end) in bytes.

    Read here rather than with ``safetensors.safe_open``, whose torch backend reads the whole file into
    process memory when it opens it (measured: one model-sized copy)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        n = int.from_bytes(m[:8], "little")
        header = json.loads(m[8:8 + n])
        table = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            begin, end = (8 + n + int(x) for x in e["data_offsets"])
            if not 8 + n <= begin <= end <= len(m):
                raise ValueError(f"{name}: data offsets out of the file")
            table[name] = (DTYPES[e["dtype"]][1], [int(d) for d in e["shape"]], begin, end)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        m.close()
        raise IntegrityError(f"checkpoint weights {path} are not safetensors: {exc}") from exc
    return m, table


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Copy the safetensors file ``path`` into ``model``'s tensors one at a time from a read-only mapping
    (strict: the same names and shapes), never materialising a second full state dict."""
    target = model.state_dict()  # references to the model's own tensors
    try:
        m, table = _mapped_tensors(path)
    except OSError as exc:
        raise IntegrityError(f"checkpoint weights {path} are unreadable: {exc}") from exc
    with m:
        if set(table) != set(target):
            missing, extra = sorted(set(target) - set(table)), sorted(set(table) - set(target))
            raise IntegrityError(f"{path} does not fit the model: missing {missing[:5]}, "
                                 f"unexpected {extra[:5]}")
        with torch.no_grad():
            for name, (dtype, shape, begin, end) in sorted(table.items()):
                dst = target[name]
                if list(dst.shape) != shape:
                    raise IntegrityError(f"{path}: {name} has shape {shape}, the model {list(dst.shape)}")
                if end > begin:
                    raw = np.frombuffer(m, dtype=np.uint8, count=end - begin, offset=begin)
                    # One tensor's copy at a time (torch cannot alias a read-only buffer); copy_ casts
                    # when the model holds another dtype than the file.
                    dst.copy_(torch.tensor(raw).view(dtype).reshape(shape))
                    del raw  # the mapping cannot close while a view of it is alive


def read_optimizer(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The latest checkpoint's optimizer state (memory-mapped tensors), None when there is none."""
    path = latest_dir(root)
    if path is None or not (path / "optimizer.pt").exists():
        return None
    state: dict[str, Any] = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True,
                                       mmap=True)
    return state


def load_checkpoint(root: str | os.PathLike[str], model: torch.nn.Module,
                    optimizer: Optimizer | None = None) -> TrainerState | None:
    """Load the latest checkpoint into ``model`` (and ``optimizer``); None when there is none yet."""
    path = latest_dir(root)
    if path is None:
        return None
    state = read_state(path)
    load_weights(path / "model.safetensors", model)
    if optimizer is not None:
        saved = read_optimizer(root)
        if saved is not None:
            optimizer.load_state_dict(saved)
    return state


def latest_weights_path(root: str | os.PathLike[str]) -> Path | None:
    """Path of the newest committed policy weights (what a trainer publishes)."""
    path = latest_dir(root)
    return None if path is None else path / "model.safetensors"


def committed_policy(root: str | os.PathLike[str], path: Path | None = None) -> PolicyWeights:
    """The weights of the latest checkpoint (or of the checkpoint directory ``path``) as a canonical
    policy file mapped read-only: what the trainer publishes, without copying the model in memory."""
    path = path if path is not None else latest_dir(root)
    if path is None:
        raise IntegrityError(f"no checkpoint under {root} to publish")
    try:
        return PolicyWeights.load(path / "model.safetensors", max_size=1 << 62)
    except ProtocolError:  # written before weights were canonical: copy them once
        from safetensors.torch import load_file

        return PolicyWeights.from_state_dict(load_file(str(path / "model.safetensors")))
