"""The ``intellect-node`` command line: a thin typer layer over the library.

Each command group lives in ``intellect_node/commands/<group>.py`` and exposes ``register(app)``.
Heavy imports (torch, libp2p) happen inside the commands, after arguments are parsed, so ``--help``
is instant. Operator mistakes (:class:`ConfigError`) print the field and the fix and exit with code 2.
"""

from __future__ import annotations

import importlib
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
