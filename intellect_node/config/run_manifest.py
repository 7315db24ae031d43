"""A node's configuration from a run manifest (``join --run CID``), and the run-wide part of a config.

The manifest (``protocol/run_manifest.py``) carries the ``[run]`` and ``[rl]`` settings every node of the
run shares, minus :data:`LOCAL_FIELDS`: paths on this machine (the model folder and thresholds file,
which ``join --run`` fetches and writes itself) and the trainer's hardware choices. A node joining by
CID takes every shared setting from the manifest; setting one of them locally as well (``--config``, an
``INTELLECT_NODE_RUN__*`` variable, ``--run-id``...) is refused naming the field, since the run would
then not be the one the CID names. The local fields, the network and every other section stay the
node's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from intellect_node.config.loader import build_config, deep_merge
from intellect_node.config.schema import NodeConfig
from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.protocol.run_manifest import RunManifest

RUN_SECTIONS = ("run", "rl")
LOCAL_FIELDS = frozenset({
    "run.model", "run.proof_thresholds",
    "rl.reward_timeout_s", "rl.train_device", "rl.train_implementation", "rl.micro_batch_tokens",
    "rl.gradient_checkpointing", "rl.checkpoint_every",
})
"""Fields a manifest does not carry: this machine's paths, and choices that change how fast a node works
but not what the run computes."""
DERIVED_FIELDS = frozenset({"run.proof_thresholds_sha256"})
"""Shared fields a manifest does not list because it implies them: the thresholds' hash is the hash of
the thresholds it carries."""


def run_sections(cfg: NodeConfig) -> dict[str, dict[str, Any]]:
    """The shared ``[run]`` and ``[rl]`` settings of ``cfg`` as a manifest carries them. ConfigError for
    what a manifest cannot carry (a solve-rates file is a path on the organiser's machine)."""
    if cfg.rl.solve_rates_file is not None or cfg.rl.tasks_file is not None:
        field = "rl.solve_rates_file" if cfg.rl.solve_rates_file is not None else "rl.tasks_file"
        raise ConfigError(f"{field} names a file on this machine, which a run manifest does not carry; "
                          "use a reasoning-gym environment (--env) and no offline filter", field=field)
    out: dict[str, dict[str, Any]] = {}
    left_out = LOCAL_FIELDS | DERIVED_FIELDS
    for section in RUN_SECTIONS:
        values = getattr(cfg, section).model_dump(mode="json")
        out[section] = {k: v for k, v in values.items() if f"{section}.{k}" not in left_out}
    return out


def shared_fields_set(local: Mapping[str, Any], origin: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(field, where)`` of every shared ``[run]``/``[rl]`` field the node's own layers set."""
    out = []
    for section in RUN_SECTIONS:
        for name in (local.get(section) or {}):
            field = f"{section}.{name}"
            if field not in LOCAL_FIELDS:
                out.append((field, origin.get(field, "the config")))
    return out


def config_from_manifest(m: RunManifest, *, local: Mapping[str, Any], origin: Mapping[str, str],
                         model_dir: Path, thresholds: Path) -> NodeConfig:
    """The node's configuration: its own layers (``local``: file, variables, flags as
    ``config.loader.config_layers`` merges them, ``origin`` where each was set) with the manifest's
    shared settings, the fetched model folder and the thresholds file written from the manifest.
    ConfigError for a shared field set locally, or a manifest whose settings this version refuses."""
    clash = shared_fields_set(local, origin)
    if clash:
        field, where = clash[0]
        raise ConfigError(f"{field} (set in {where}) comes from the run manifest when joining with --run; "
                          "drop it from your config, flags and environment", field=field)
    try:
        shared = m.config_dict()
    except ValueError as exc:  # checked when the manifest was opened; here for a hand-made object
        raise ProtocolError(f"the run manifest's config is not JSON: {exc}") from exc
    paths = {"run": {"model": str(model_dir), "proof_thresholds": str(thresholds),
                     "proof_thresholds_sha256": m.thresholds_sha256}}
    merged = deep_merge(deep_merge(dict(local), shared), paths)
    try:
        return build_config(merged)
    except ConfigError as exc:
        raise ConfigError(f"the run manifest's settings are refused by this node: {exc}; the organiser "
                          "made the run with a version of intellect-node that has other settings",
                          field=exc.field) from exc
