"""``intellect-node config show``: the configuration a node would run with, and where each value came from.

It goes through the loader ``join`` uses (``node/config/loader.py``: ``--config FILE``, else
``$INTELLECT_NODE_CONFIG``, else ``<data-dir>/config.toml``; then ``INTELLECT_NODE_<SECTION>__<FIELD>``
variables; then flags), so what it prints is what ``join`` with the same environment and flags gets.
Flags: everything after ``show``'s own options is parsed by ``join``'s own parser, so
``intellect-node config show --bootstrap /ip4/...`` reports that value as coming from ``--bootstrap``, and
a flag ``join`` would refuse is refused here too.

The output is TOML that ``--config`` accepts: each field at its effective value, each line ending with
``# default``, ``# file <path>``, ``# env <VARIABLE>`` or ``# flag --name``. Unset optional fields are
printed commented out. ``--json`` prints ``{"file": ..., "values": {...}, "origin": {...}}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError


def _join_flags(args: list[str]) -> dict[str, Any]:
    """Parse ``args`` with the ``join`` command's parser; the config layer of the flags given."""
    import click

    from intellect_node.cli import app
    from intellect_node.commands.join import join_flags

    join_cmd = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    try:
        ctx = join_cmd.make_context("join", list(args), resilient_parsing=False)
    except click.exceptions.UsageError as exc:
        raise ConfigError(f"{exc.format_message()} (flags after `config show` are join's flags)",
                          field="flags") from exc
    params = dict(ctx.params)
    for name in ("config_file", "data_dir_opt"):
        if params.get(name) is not None:
            raise ConfigError(f"give --{'config' if name == 'config_file' else 'data-dir'} before the "
                              "join flags, as an option of `config show`", field="flags")
    params["validator_peer_ids"] = params.pop("validator_peer_id", None)
    return join_flags(**params)


def _source(where: str | None) -> str:
    """The loader's origin text (a file path, a variable, a flag) as ``config show`` labels it."""
    if where is None:
        return "default"
    if where.startswith("INTELLECT_NODE_"):
        return f"env {where}"
    if where.startswith("--") or where == "a command-line flag":
        return f"flag {where}"
    return f"file {where}"


def effective(config_file: Path | None, d: Path, flags: dict[str, Any]) -> tuple[Path | None, Any, dict]:
    """``(file read, validated NodeConfig, section.field -> source text)``; ConfigError like ``join``."""
    from intellect_node.commands.join import FLAG_OF_FIELD
    from intellect_node.node.config import config_layers, load_config, section_models

    file, _merged, origin = config_layers(config_file, flags=flags, data_dir=d, flag_names=FLAG_OF_FIELD)
    cfg = load_config(config_file, flags=flags, data_dir=d, flag_names=FLAG_OF_FIELD)
    sources = {f"{section}.{name}": _source(origin.get(f"{section}.{name}"))
               for section, model in section_models().items() for name in model.model_fields}
    return file, cfg, sources


def as_toml(cfg: Any, sources: dict[str, str], file: Path | None) -> str:
    """The config as TOML with each field's source; values as JSON, which TOML reads alike for the
    strings, numbers, booleans and lists a config holds."""
    from intellect_node.node.config import section_models

    lines = ["# The effective intellect-node configuration (`intellect-node config show`).",
             f"# Read from: {file if file is not None else 'no config file (defaults)'}; then "
             "INTELLECT_NODE_<SECTION>__<FIELD> variables; then join's flags.", ""]
    for section, model in section_models().items():
        lines.append(f"[{section}]")
        values = getattr(cfg, section).model_dump(mode="json")
        width = max((len(f"{n} = {json.dumps(values[n])}") for n in model.model_fields), default=0)
        for name in model.model_fields:
            value = values[name]
            text = f"# {name} =" if value is None else f"{name} = {json.dumps(value)}"
            lines.append(f"{text:<{min(width, 70)}}  # {sources[f'{section}.{name}']}")
        lines.append("")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    config = typer.Typer(help="The node's configuration: what it runs with and where each value came from.",
                         no_args_is_help=True)

    @config.command("show", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def show(
        ctx: typer.Context,
        data_dir_opt: Optional[Path] = DataDirOption,
        config_file: Optional[Path] = typer.Option(
            None, "--config", "-c", help="TOML config (default: $INTELLECT_NODE_CONFIG, else "
                                         "<data-dir>/config.toml if present)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object: file, values, origin."),
    ) -> None:
        """Print the effective configuration (TOML) with each value's source: default, file, env or flag.

        Further arguments are join's flags (e.g. --bootstrap ADDR --run-id R), taken as join takes them.
        """
        d = data_dir(data_dir_opt)
        flags = _join_flags(list(ctx.args))
        file, cfg, sources = effective(config_file, d, flags)
        if as_json:
            typer.echo(json.dumps({"file": str(file) if file else None, "values": cfg.model_dump(mode="json"),
                                   "origin": sources}))
            return
        typer.echo(as_toml(cfg, sources, file), nl=False)

    app.add_typer(config, name="config")
