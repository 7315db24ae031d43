"""``intellect-node config show``: the configuration a node would run with, and where each value came from.

It goes through the loader ``join`` uses (``config/loader.py``: ``--config FILE``, else
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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from intellect_node.commands.common import DataDirOption, NodeConfigOption, data_dir
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig


def _join_flags(args: list[str]) -> dict[str, object]:
    """Parse ``args`` with the ``join`` command's parser; the config layer of the flags given."""
    from intellect_node.cli import app
    from intellect_node.commands.join import join_flags

    # typer ships its own copy of click: its group and errors are not the `click` package's classes
    group = typer.main.get_command(app)
    commands = getattr(group, "commands", None)
    if not isinstance(commands, dict) or "join" not in commands:
        raise RuntimeError("the CLI has no join command")
    join_cmd = commands["join"]
    try:
        ctx = join_cmd.make_context("join", list(args), resilient_parsing=False)
    except Exception as exc:  # a usage error of typer's click names the bad flag
        message = getattr(exc, "format_message", None)
        if not callable(message):
            raise
        raise ConfigError(f"{message()} (flags after `config show` are join's flags)",
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


def effective(config_file: Path | None, d: Path,
              flags: Mapping[str, object]) -> tuple[Path | None, NodeConfig, dict[str, str]]:
    """``(file read, validated NodeConfig, section.field -> source text)``; ConfigError like ``join``."""
    from intellect_node.commands.join import FLAG_OF_FIELD
    from intellect_node.config import config_layers, load_config, section_models

    file, _merged, origin = config_layers(config_file, flags=flags, data_dir=d, flag_names=FLAG_OF_FIELD)
    cfg = load_config(config_file, flags=flags, data_dir=d, flag_names=FLAG_OF_FIELD)
    sources = {f"{section}.{name}": _source(origin.get(f"{section}.{name}"))
               for section, model in section_models().items() for name in model.model_fields}
    return file, cfg, sources


def as_toml(cfg: NodeConfig, sources: dict[str, str], file: Path | None) -> str:
    """The config as TOML with each field's source; values as JSON, which TOML reads alike for the
    strings, numbers, booleans and lists a config holds."""
    from intellect_node.config import section_models

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
        config_file: Optional[Path] = NodeConfigOption,
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

    @config.command("fit")
    def fit(
        model: str = typer.Option(..., "--model", help="Model folder or .gguf file."),
        env: Optional[str] = typer.Option(None, "--env", help="Reward environment (rl.env), e.g. "
                                                              "reasoning_gym:chain_sum."),
        env_args: Optional[str] = typer.Option(None, "--env-args", help="rl.env_args: JSON, or key=value "
                                                                        "pairs separated by commas."),
        config_file: Optional[Path] = typer.Option(None, "--config", "-c",
                                                   help="A config whose [rl] values are kept as given."),
        check: bool = typer.Option(False, "--preflight", help="Also sample the starting policy on 8 of the "
                                                              "run's problems and say whether anything is "
                                                              "learnable (exit 1 when nothing is)."),
    ) -> None:
        """Print the [rl] settings that fit MODEL and the environment, each with why (TOML to paste
        into the run's config). Given values (--config's [rl], --env, --env-args) are kept."""
        from intellect_node.commands.common import parse_env_args
        from intellect_node.config.loader import read_toml, toml_table
        from intellect_node.inference.run_settings import fit_settings, model_facts, size_text
        from intellect_node.models.loader import resolve_model_dir

        folder = resolve_model_dir(model)
        given = toml_table(read_toml(config_file), "rl") if config_file is not None else {}
        if env:
            given["env"] = env
        if env_args:
            given["env_args"] = parse_env_args(env_args)
        facts = model_facts(folder)
        choices = fit_settings(facts, given)
        typer.echo(f"# settings for {folder} ({size_text(facts.n_params)} parameters"
                   f"{', chat template' if facts.chat_template else ', no chat template'})")
        typer.echo("[rl]")
        if facts.embedded and not choices:
            typer.echo("# the embedded model: the defaults are its settings")
        for c in choices:
            typer.echo(f"{c.key} = {_toml_inline(c.value)}  # {'given' if c.given else c.why}")
        if check:
            raise typer.Exit(_preflight(folder, {c.key: c.value for c in choices}))

    app.add_typer(config, name="config")


def _toml_inline(value: object) -> str:
    """A value as TOML: JSON for strings, numbers, booleans and lists; an inline table for a mapping."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_inline(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def _preflight(folder: Path, rl: dict[str, Any]) -> int:
    """The preflight of ``config fit --preflight``: 0 when some group is learnable, else 1."""
    import random
    import tempfile

    import torch

    from intellect_node.config import load_config
    from intellect_node.inference import make_engine
    from intellect_node.inference.run_settings import preflight
    from intellect_node.node.processes import write_config
    from intellect_node.roles.common.tasks import run_task

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = write_config(Path(d) / "fit.toml", {"run": {"model": str(folder)}, "rl": rl})
        cfg = load_config(path, environ={})
    problems = run_task(cfg).sample(random.Random(7), 8)
    pre = preflight(make_engine(folder, "torch"), problems, group_size=cfg.rl.group_size,
                    max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature)
    typer.echo("\n".join(f"# {line}" for line in pre.summary().splitlines()))
    return 0 if pre.ok() else 1
