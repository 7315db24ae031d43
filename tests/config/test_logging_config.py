"""The ``[logging]`` section: a mirror whose package is missing is refused at load naming the field and
the fix (the node exits 2 at start, never at its first step); the defaults turn nothing on."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from intellect_node.config import build_config
from intellect_node.errors import ConfigError


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_mirror_without_its_package_is_refused_naming_the_field(
        monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package_name: str | None = None) -> ModuleSpec | None:
        return None if name == package else real(name, package_name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=rf"{package} is not installed") as info:
        build_config({"logging": {package: True}})
    assert info.value.field == f"logging.{package}"
    assert "pip install 'intellect-node[logging]'" in str(info.value)
    assert f"logging.{package} = false" in str(info.value)
    other = "tensorboard" if package == "wandb" else "wandb"
    assert build_config({"logging": {other: True}}).logging.model_dump()[other] is True


def test_logging_is_off_by_default_and_offline_when_on() -> None:
    cfg = build_config({})
    assert not cfg.logging.wandb and not cfg.logging.tensorboard
    on = build_config({"logging": {"wandb": True}})
    assert on.logging.wandb_mode == "offline" and on.logging.wandb_project == "intellect-node"
    with pytest.raises(ConfigError, match="offline") as info:
        build_config({"logging": {"wandb_mode": "cloud"}})
    assert info.value.field == "logging.wandb_mode"
    with pytest.raises(ConfigError, match="W&B project names") as info:
        build_config({"logging": {"wandb_project": "team/run"}})
    assert info.value.field == "logging.wandb_project"
