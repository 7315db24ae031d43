"""The optimizer state as a content-addressed file: what the trainer publishes with each checkpoint.

An auditor replays a window of steps that starts at a checkpoint (``roles/auditor/``); AdamW's next
update depends on its moments, so the window's start is the checkpoint's weights *and* its optimizer
state. This module writes that state in one canonical encoding and reads it back into an optimizer:

- the file is the canonical tensor file of ``policy/weights.py`` (the same bytes for the same state, its
  CID the content hash), holding for each parameter ``i`` with state (its index in
  ``model.parameters()``, six digits) the tensors ``<i>.exp_avg``, ``<i>.exp_avg_sq`` and ``<i>.step`` (a
  float32 scalar), exactly as torch's ``AdamW.state_dict`` holds them (and ``trainer/optim.CpuAdamW``'s);
- the hyperparameters (lr, betas, eps, weight decay) are not state and are not in the file: the step
  records state them, and a reader builds its optimizer from those (:func:`load_optimizer`), so a file
  cannot change the learning rate a replay uses.

Reading is strict: a name that is not one of the three per-parameter entries, an index out of the model,
a parameter with part of its entries, or a shape or dtype that does not fit the parameter raises
:class:`~intellect_node.errors.ProtocolError` (the bytes come from a peer).

Shortcuts: AdamW only (the trainer's one optimizer), one parameter group; the state is gathered into
one file on the CPU (a GPU trainer's moments are copied out tensor by tensor as it is written).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from intellect_node.errors import ProtocolError
from intellect_node.policy.weights import PolicyWeights, file_size
from intellect_node.trainer.optim import Optimizer

ENTRIES = ("exp_avg", "exp_avg_sq", "step")
_NAME = re.compile(r"(\d{6})\.(exp_avg|exp_avg_sq|step)")
MAX_PARAMS = 999_999  # six digits of parameter index


def _tensors(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, st in state_dict["state"].items():
        if not 0 <= int(i) <= MAX_PARAMS:
            raise ValueError(f"optimizer state names parameter {i}")
        for key in ENTRIES:
            t = torch.as_tensor(st[key], dtype=torch.float32) if key == "step" else st[key]
            out[f"{int(i):06d}.{key}"] = t.detach().to("cpu").contiguous()
    return out


def size_bound(params: Sequence[torch.Tensor]) -> int:
    """The size in bytes of the canonical file of a state holding every one of ``params`` (in order, as
    ``model.parameters()`` gives them): each parameter's two moments in its dtype and its float32 step.

    Exact for a state where every parameter has taken a step (the trainer's after any step in which
    every parameter had a gradient); a parameter that never had one has no state, and a state of fewer
    parameters is smaller (shorter header, less data), so this bounds every state of this model. Neither
    the step count nor anything else outside the model changes it: the step is one float32 scalar."""
    step = torch.empty((), dtype=torch.float32, device="meta")
    layout: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        layout[f"{i:06d}.exp_avg"] = layout[f"{i:06d}.exp_avg_sq"] = p
        layout[f"{i:06d}.step"] = step
    return file_size(layout)


def encode_optimizer(opt: Optimizer) -> PolicyWeights:
    """``opt``'s state in the canonical encoding (in memory: small models and tests)."""
    return PolicyWeights.from_state_dict(_tensors(opt.state_dict()))


def write_optimizer(path: str | os.PathLike[str], opt: Optimizer) -> str:
    """Write ``opt``'s state canonically to ``path`` (atomically, streamed one tensor at a time); its CID."""
    return PolicyWeights.write(path, _tensors(opt.state_dict())).content_hash


def decode_optimizer(weights: PolicyWeights, params: list[torch.Tensor]) -> dict[str, Any]:
    """The ``state`` part of a torch AdamW state dict held by ``weights``, checked against ``params``."""
    seen: dict[int, set[str]] = {}
    for name, info in weights.tensors.items():
        m = _NAME.fullmatch(name)
        if m is None:
            raise ProtocolError(f"optimizer state: {name[:64]!r} is not <index>.exp_avg|exp_avg_sq|step")
        i, key = int(m.group(1)), m.group(2)
        if i >= len(params):
            raise ProtocolError(f"optimizer state names parameter {i}; the model has {len(params)}")
        want = () if key == "step" else tuple(params[i].shape)
        if info.shape != want:
            raise ProtocolError(f"optimizer state {name}: shape {list(info.shape)}, the parameter needs "
                                f"{list(want)}")
        seen.setdefault(i, set()).add(key)
    for i, keys in seen.items():
        if keys != set(ENTRIES):
            raise ProtocolError(f"optimizer state of parameter {i} holds {sorted(keys)}, not {list(ENTRIES)}")
    tensors = weights.to_state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i in sorted(seen):
        st = state[i] = {key: tensors[f"{i:06d}.{key}"] for key in ENTRIES}
        wants = {"step": torch.float32, "exp_avg": params[i].dtype, "exp_avg_sq": params[i].dtype}
        for key, t in st.items():
            if t.dtype != wants[key]:
                raise ProtocolError(f"optimizer state {i:06d}.{key} is {t.dtype}, it must be {wants[key]}")
    return {"state": state}


def load_optimizer(opt: Optimizer, weights: PolicyWeights) -> None:
    """Load the state ``weights`` holds into ``opt`` (built over the model with the records' settings: its
    hyperparameters stay)."""
    params: list[torch.Tensor] = [p for g in opt.param_groups for p in g["params"]]
    state = decode_optimizer(weights, params)["state"]
    current = opt.state_dict()
    try:
        opt.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ProtocolError(f"optimizer state does not load: {exc}") from exc
