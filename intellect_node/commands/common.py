"""Options and helpers shared by the command modules."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from intellect_node.p2p.identity import resolve_data_dir

DataDirOption = typer.Option(
    None, "--data-dir", "-d",
    help="Node data directory (key, blobs, ledger). Default: $INTELLECT_NODE_DATA_DIR, else the "
         "platform's user data directory.",
)


def data_dir(value: Optional[Path]) -> Path:
    return resolve_data_dir(value)


@contextmanager
def data_dir_lock(d: Path) -> Iterator[None]:
    """Hold the node's data-dir lock while a command works on the store without a node: a node that is
    starting must not share it with us. ConfigError (exit 2) when a node holds it."""
    import fcntl
    import os

    from intellect_node.errors import ConfigError
    from intellect_node.node.runtime import LOCK_FILE

    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ConfigError(f"a node is starting with --data-dir {d}; retry when `intellect-node status` "
                              "answers", field="data_dir") from exc
        yield
    finally:
        os.close(fd)
