"""Options and helpers shared by the command modules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from intellect_node.p2p.identity import resolve_data_dir

DataDirOption = typer.Option(
    None, "--data-dir", "-d",
    help="Node data directory (key, blobs, ledger). Default: $INTELLECT_NODE_DATA_DIR, else the "
         "platform's user data directory.",
)


def data_dir(value: Optional[Path]) -> Path:
    return resolve_data_dir(value)
