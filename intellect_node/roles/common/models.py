"""The run's model: its folder, its base (config, tokenizer, tensor shapes), and a policy checkpoint's weights
loaded onto it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from intellect_node.config import NodeConfig
from intellect_node.errors import IntegrityError
from intellect_node.models.loader import LoadedModel, load_model, resolve_model_dir, torch_dtype
from intellect_node.policy.weights import PolicyWeights

MAX_POLICY_BYTES = 4 << 30
"""Largest policy checkpoint a worker or validator accepts (the announced size is checked first)."""


def model_dir(cfg: NodeConfig) -> Path:
    return resolve_model_dir(cfg.run.model or None)


def loaded_from_checkpoint(base: LoadedModel, ckpt: PolicyWeights) -> LoadedModel:
    """``base`` (config, tokenizer) with the weights of ``ckpt`` in the run's dtype; IntegrityError when
    the checkpoint lacks a tensor of the model or holds one of another shape."""
    dt = torch_dtype(base.dtype)
    state = {k: v.to(dtype=dt) if v.is_floating_point() else v for k, v in ckpt.to_state_dict().items()}
    missing = set(base.state) - set(state)
    if missing:
        raise IntegrityError(f"policy checkpoint lacks {sorted(missing)[:3]}")
    wrong = sorted(k for k, v in base.state.items() if state[k].shape != v.shape)
    if wrong:
        raise IntegrityError(f"policy checkpoint's {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the "
                             f"model's {tuple(base.state[wrong[0]].shape)}")
    return replace(base, state=state)


def base_model(cfg: NodeConfig) -> LoadedModel:
    """The run's model for a worker or validator: its config and tokenizer, and its tensors' shapes only
    (``load_model(weights=False)``): their weights are always a policy checkpoint's
    (:func:`loaded_from_checkpoint`), so the folder's are never read into memory."""
    return load_model(cfg.run.model or None, dtype=cfg.run.dtype, weights=False)
