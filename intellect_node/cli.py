"""The ``intellect-node`` command line: a thin typer layer over the library.

Each command group lives in ``intellect_node/commands/<group>.py`` and exposes ``register(app)``.
Heavy imports (torch, libp2p) happen inside the commands, after arguments are parsed, so ``--help``
is instant. Operator mistakes (:class:`ConfigError`) print the field and the fix and exit with code 2.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import typer

from intellect_node import __version__, gcpolicy
from intellect_node.errors import ConfigError

app = typer.Typer(
    name="intellect-node",
    help=(
        "Join a permissionless swarm that trains language models with reinforcement learning.\n\n"
        "Start here: `intellect-node keys init`, then `intellect-node join --bootstrap <multiaddr>`.\n"
        "Try everything locally first with `intellect-node demo`."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

COMMAND_MODULES = (
    "keys", "join", "status", "blob", "model", "tasks", "rollout", "proofs", "sweep", "demo", "ledger",
    "doctor", "stop", "logs", "config", "service", "peers", "run", "runs", "audit",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"intellect-node {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    pass


for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"intellect_node.commands.{_name}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"intellect_node.commands.{_name}":
            raise
        continue
    _mod.register(app)


def _unwrap(text: str) -> str:
    """``text`` with each paragraph's single line breaks turned into spaces, so that rich wraps the help to
    the terminal rather than at the source's line ends. Paragraphs marked ``\\b`` and lines that start a
    list item or are indented keep their breaks."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    out = []
    for para in paragraphs:
        if para.startswith("\b"):
            out.append(para)
            continue
        lines = para.split("\n")
        joined = lines[0]
        for line in lines[1:]:
            numbered = line[:1].isdigit() and line.split(" ", 1)[0].endswith(".")
            keep = numbered or line.startswith((" ", "- ", "* "))
            joined += ("\n" if keep else " ") + line
        out.append(joined)
    return "\n\n".join(out)


def _unwrap_help(tapp: typer.Typer) -> None:
    """Apply :func:`_unwrap` to every help text and docstring that typer renders for ``tapp``'s tree."""
    infos: list[typer.models.CommandInfo | typer.models.TyperInfo] = [tapp.info, *tapp.registered_commands]
    if tapp.registered_callback is not None:
        infos.append(tapp.registered_callback)
    for group in tapp.registered_groups:
        infos.append(group)
        if group.typer_instance is not None:
            _unwrap_help(group.typer_instance)
    for info in infos:
        if isinstance(info.help, str):
            info.help = _unwrap(info.help)
        callback = info.callback
        if callback is not None and callback.__doc__:
            callback.__doc__ = _unwrap(callback.__doc__)


_unwrap_help(app)


NODE_COMMANDS = frozenset({"join", "sweep"})
"""Commands that run a node in this process: its start-up holds the garbage collector off until the node
runtime settles it (:mod:`intellect_node.gcpolicy`). Others (the demo's supervisor, one-shot tools) keep
the collector as it is."""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in NODE_COMMANDS:
        gcpolicy.defer()  # a node's start-up builds a large heap: no full collections until it settles
    try:
        app()
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
