"""A node's configuration from a run manifest (``join --run CID``), and the run-wide part of a config.

The manifest (``protocol/run_manifest.py``) carries the ``[run]`` and ``[rl]`` settings every node of the
run shares, minus :data:`LOCAL_FIELDS`: paths on this machine (the model folder and thresholds file,
which ``join --run`` fetches and writes itself) and the trainer's hardware choices. A node joining by
CID takes every shared setting from the manifest, and nothing else: a manifest that sets a local
field, a machine file or another section is refused naming it (:func:`manifest_refusal`); setting a
shared field locally as well (``--config``, an
``INTELLECT_NODE_RUN__*`` variable, ``--run-id``...) is refused naming the field, since the run would
then not be the one the CID names. The local fields, the network and every other section stay the
node's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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


def run_sections(cfg: NodeConfig) -> dict[str, dict[str, object]]:
    """The shared ``[run]`` and ``[rl]`` settings of ``cfg`` as a manifest carries them. ConfigError for
    what a manifest cannot carry (a solve-rates file is a path on the organiser's machine)."""
    if cfg.rl.solve_rates_file is not None or cfg.rl.tasks_file is not None:
        field = "rl.solve_rates_file" if cfg.rl.solve_rates_file is not None else "rl.tasks_file"
        raise ConfigError(f"{field} names a file on this machine, which a run manifest does not carry; "
                          "use a reasoning-gym environment (--env) and no offline filter", field=field)
    out: dict[str, dict[str, object]] = {}
    left_out = LOCAL_FIELDS | DERIVED_FIELDS
    for section in RUN_SECTIONS:
        values = getattr(cfg, section).model_dump(mode="json")
        out[section] = {k: v for k, v in values.items() if f"{section}.{k}" not in left_out}
    return out


def shared_fields_set(local: Mapping[str, object], origin: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(field, where)`` of every shared ``[run]``/``[rl]`` field the node's own layers set."""
    out = []
    for section in RUN_SECTIONS:
        values = local.get(section)
        for name in (values if isinstance(values, Mapping) else {}):
            field = f"{section}.{name}"
            if field not in LOCAL_FIELDS:
                out.append((field, origin.get(field, "the config")))
    return out


MACHINE_FILES = frozenset({"rl.tasks_file", "rl.solve_rates_file"})
"""Shared fields that name a file on the organiser's machine: a manifest carries them unset (null) only
(:func:`run_sections` refuses a config that sets them)."""


def manifest_refusal(shared: Mapping[str, object]) -> str | None:
    """Why a manifest's config sets something that is not a shared run setting (another section, a
    field in :data:`LOCAL_FIELDS` or :data:`DERIVED_FIELDS`, a machine file in :data:`MACHINE_FILES`
    set), or None. The manifest is the organiser's word: it must not choose a joining node's paths,
    device or checkpoint cadence."""
    for section, values in shared.items():
        if section not in RUN_SECTIONS or not isinstance(values, Mapping):
            return f"{str(section)[:40]!r} is not a shared run setting (only [run] and [rl] are)"
        for name, value in values.items():
            field = f"{section}.{str(name)[:40]}"
            machine_file = field in MACHINE_FILES and value is not None
            if field in LOCAL_FIELDS or field in DERIVED_FIELDS or machine_file:
                return f"{field} is not a shared run setting (it is this node's own)"
    return None


def config_from_manifest(m: RunManifest, *, local: Mapping[str, object], origin: Mapping[str, str],
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
    if not isinstance(shared, Mapping):
        raise ProtocolError("the run manifest's config is not a JSON object")
    why = manifest_refusal(shared)
    if why:
        raise ProtocolError(f"the run manifest sets {why}; refused (its organiser's node or an attacker "
                            "put it there)")
    paths = {"run": {"model": str(model_dir), "proof_thresholds": str(thresholds),
                     "proof_thresholds_sha256": m.thresholds_sha256}}
    merged = deep_merge(deep_merge(dict(local), shared), paths)
    try:
        return build_config(merged)
    except ConfigError as exc:
        raise ConfigError(f"the run manifest's settings are refused by this node: {exc}; the organiser "
                          "made the run with a version of intellect-node that has other settings",
                          field=exc.field) from exc
