"""``write_config`` writes files the node's loader reads back, nested tables included."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from intellect_node.config import load_config
from intellect_node.node.processes import write_config


def test_nested_tables_round_trip_through_the_loader(tmp_path: Path) -> None:
    doc: dict[str, dict[str, Any]] = {"run": {"run_id": "nested"},
           "rl": {"env": "reasoning_gym:chain_sum", "env_args": {"min_terms": 2, "max_terms": 3}, "lr": 1e-4}}
    path = write_config(tmp_path / "config.toml", doc)
    assert tomllib.loads(path.read_text()) == doc
    cfg = load_config(path)
    assert cfg.rl.env == "reasoning_gym:chain_sum"
    assert dict(cfg.rl.env_args) == {"min_terms": 2, "max_terms": 3}
