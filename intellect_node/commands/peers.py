"""``intellect-node peers``: the bans a node keeps across restarts (``peers.json``, see ``p2p/peerbook.py``).

``peers bans`` lists them (the node may be running: it reads the file the node writes at each ban).
``peers unban PEER`` lifts one; it refuses while a node runs with the data dir, since that node holds the
ban in memory and would write it back.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir, data_dir_lock
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.p2p.peerbook import PeerBook


def _book(d: Path) -> "PeerBook":
    """The data dir's peer book as a node would load it (bans older than a week dropped)."""
    from intellect_node.p2p.peerbook import PeerBook

    return PeerBook("", d)


def register(app: typer.Typer) -> None:
    peers = typer.Typer(help="Peers this node banned (kept across restarts) and lifting a ban.",
                        no_args_is_help=True)

    @peers.command("bans")
    def bans(
        data_dir_opt: Optional[Path] = DataDirOption,
        as_json: bool = typer.Option(False, "--json", help="One JSON document: a list of bans."),
    ) -> None:
        """List banned peers, newest ban first: peer ID, when, why."""
        found = _book(data_dir(data_dir_opt)).bans()
        if as_json:
            typer.echo(json.dumps(found, indent=1))
            return
        if not found:
            typer.echo("no banned peers")
        for b in found:
            when = datetime.datetime.fromtimestamp(b["at"] or 0, datetime.timezone.utc)
            typer.echo(f"{b['peer_id']}  {when:%Y-%m-%d %H:%M:%S}Z  {b['reason']}")

    @peers.command("unban")
    def unban(
        peer: str = typer.Argument(..., help="The banned peer's ID (12D3KooW...)."),
        data_dir_opt: Optional[Path] = DataDirOption,
    ) -> None:
        """Lift a ban kept in the data dir (stop the node first)."""
        from intellect_node.commands.stop import lock_held

        d = data_dir(data_dir_opt)
        if lock_held(d):
            raise ConfigError(f"a node is running with --data-dir {d}; stop it (`intellect-node stop`), "
                              "unban, then start it again", field="data_dir")
        with data_dir_lock(d):  # no node starts while the file is rewritten
            book = _book(d)
            if not book.unban(peer):
                raise ConfigError(f"{peer} is not banned in {d} (`intellect-node peers bans` lists the "
                                  "bans)", field="peer")
            book.save(force=True)
        typer.echo(f"unbanned {peer}")

    app.add_typer(peers, name="peers")
