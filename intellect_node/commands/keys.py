"""``intellect-node keys``: create and show the node's ed25519 identity."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.p2p import identity


def register(app: typer.Typer) -> None:
    keys = typer.Typer(help="The node's identity: one ed25519 key, its libp2p peer ID and message signer.",
                       no_args_is_help=True)

    @keys.command("init")
    def init(
        data_dir_opt: Optional[Path] = DataDirOption,
        force: bool = typer.Option(False, "--force", help="Replace an existing key (the peer ID changes)."),
    ) -> None:
        """Create the node key (mode 0600) and print its peer ID."""
        d = data_dir(data_dir_opt)
        key = identity.init_key(d, force=force)
        typer.echo(f"created {identity.key_path(d)}")
        typer.echo(key.peer_id)

    @keys.command("show")
    def show(data_dir_opt: Optional[Path] = DataDirOption) -> None:
        """Print the node's peer ID (12D3KooW...)."""
        typer.echo(identity.load_key(data_dir(data_dir_opt)).peer_id)

    app.add_typer(keys, name="keys")
