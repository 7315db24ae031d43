"""A worker's or validator's base model (``roles/common/models.py``): the folder's config, tokenizer and
tensor shapes, never its weights; a policy checkpoint supplies those and must fit the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from intellect_node.config.loader import build_config
from intellect_node.errors import IntegrityError
from intellect_node.models.loader import LoadedModel, embedded_model_dir, load_model
from intellect_node.policy.weights import PolicyWeights
from intellect_node.roles.common.models import base_model, loaded_from_checkpoint
from intellect_node.trainer.model import initial_policy


def _base() -> LoadedModel:
    return base_model(build_config({"run": {"model": str(embedded_model_dir())}}))


def test_the_base_holds_no_weights_and_a_checkpoint_gives_them(tmp_path: Path) -> None:
    base = _base()
    assert {t.device.type for t in base.state.values()} == {"meta"}
    ckpt = initial_policy(embedded_model_dir(), tmp_path / "v0.safetensors")
    loaded = loaded_from_checkpoint(base, ckpt)
    folder = load_model(embedded_model_dir())
    assert all(torch.equal(loaded.state[k], v) for k, v in folder.state.items())
    assert loaded.tokenizer is base.tokenizer and loaded.config == folder.config


def test_a_checkpoint_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    base = _base()
    state = load_model(embedded_model_dir()).state
    name = max(state, key=lambda k: state[k].numel())
    short = {k: v for k, v in state.items() if k != name}
    with pytest.raises(IntegrityError, match="lacks"):
        loaded_from_checkpoint(base, PolicyWeights.write(tmp_path / "short.st", short))
    reshaped = {**state, name: state[name].reshape(-1)}
    with pytest.raises(IntegrityError, match=f"{name}.*shape"):
        loaded_from_checkpoint(base, PolicyWeights.write(tmp_path / "flat.st", reshaped))
