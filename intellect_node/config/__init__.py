"""The node's configuration (the schema, how it is loaded, the example file made from it), and what the
roles read and write of the node: the ledger (:mod:`.ledger`) and the status board (:mod:`.status`).

- :mod:`.schema`: the pydantic sections and :class:`NodeConfig` (``extra="forbid"``, a docstring on
  every field);
- :mod:`.loader`: file < environment < flags, and error messages that name the field and its source;
- :mod:`.example`: ``docs/config.example.toml`` from the docstrings
  (``python -m intellect_node.config > docs/config.example.toml``, which is :mod:`.__main__`);
- :mod:`.nat`: the ``[nat]`` section (reachability checks, relaying, hole punching);
- :mod:`.run_manifest`: a node's configuration from a run manifest (``join --run CID``), and the run-wide
  part of a config.

Callers import the configuration from here. It sits at the bottom of the graph: it imports nothing of
ours above ``protocol/`` (tests/test_layering.py), so every part may read it.
"""

from __future__ import annotations

from intellect_node.config.example import example_toml, field_docs
from intellect_node.config.loader import (
    CONFIG_ENV,
    DEFAULT_CONFIG_NAME,
    ENV_PREFIX,
    MAX_CONFIG_BYTES,
    build_config,
    config_file_for,
    config_layers,
    deep_merge,
    env_layer,
    load_config,
    read_toml,
)
from intellect_node.config.schema import (
    MetricsConfig,
    NetworkConfig,
    NodeConfig,
    RLConfig,
    RunConfig,
    ValidatorConfig,
    section_models,
)

__all__ = ["CONFIG_ENV", "DEFAULT_CONFIG_NAME", "ENV_PREFIX", "MAX_CONFIG_BYTES", "MetricsConfig",
           "NetworkConfig", "NodeConfig", "RLConfig", "RunConfig", "ValidatorConfig", "build_config",
           "config_file_for", "config_layers", "deep_merge", "env_layer", "example_toml", "field_docs",
           "load_config", "read_toml", "section_models"]
