"""``intellect-node blob ls | rm | gc``: what the node's blob store holds, and taking back the disk.

Where it runs: through the running node's control API when one runs (the node removes files itself, so
a removal never races its own fetches or the chunks it is serving), else directly on
``<data-dir>/blobs`` while holding the data-dir lock (a node started meanwhile refuses to start, as it
would beside another node, instead of sharing the store).

The rule ``gc`` follows: a blob is removed when it is

- not pinned: the policy chain this node's trainer announces (``trainer/policy/publisher.json``: the
  latest full checkpoint and the deltas after it; peers fetch them from the trainer first), and the runs
  it serves (``runs/*.run``: each run's manifest and model files, which participants fetch by their
  CIDs), and
- older than ``--min-age`` (default one hour; its manifest's arrival time): a worker's rollout batch is
  fetched by validators and the trainer within minutes, and a policy version a worker fetched is served
  to the workers after it for a while, so recent blobs stay; and
- not being fetched right now.

Chunks listed by no remaining blob (orphans) go with it. A running node applies the same rule by itself
every 10 minutes (``BlobService.collect_loop``); ``gc`` is for taking the disk back now. A removed
blob's provider record in the DHT expires by itself; a peer asking in between gets "not held" and tries
another provider. ``rm`` removes one blob whatever its age, a pinned one only with ``--force``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.roles.common.pins import GC_MIN_AGE_S, published_pins

if TYPE_CHECKING:
    from intellect_node.blobs.store import BlobStore

T = TypeVar("T")


def pins(d: Path) -> dict[str, str]:
    """Blob CID -> why it is pinned: the policy chain the trainer on this data dir announces, and the
    runs it serves (``roles/common/pins.py``)."""
    return published_pins(d)


def _node_running(d: Path) -> bool:
    from intellect_node.node.control import CONTROL_FILE

    return (d / CONTROL_FILE).exists()


@contextmanager
def _locked_store(d: Path) -> Iterator[BlobStore]:
    """The data dir's blob store, opened under the node's lock (no node may run meanwhile)."""
    from intellect_node.blobs.service import BLOBS_DIR
    from intellect_node.blobs.store import BlobStore
    from intellect_node.commands.common import data_dir_lock

    if not (d / BLOBS_DIR).is_dir():
        raise ConfigError(f"no blob store in {d} (nothing was put or fetched with this --data-dir)",
                          field="data_dir")
    with data_dir_lock(d):
        store = BlobStore(d / BLOBS_DIR)
        try:
            yield store
        finally:
            store.close()


def _run(d: Path, online: Callable[[], T], offline: Callable[[BlobStore], T]) -> T:
    if _node_running(d):
        return online()
    with _locked_store(d) as store:
        return offline(store)


def list_blobs(d: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``(blob infos, CIDs being fetched)`` from the node, or from the store when no node runs."""
    from intellect_node.node import control

    def online() -> tuple[list[dict[str, Any]], list[str]]:
        out = control.request(d, "GET", "/v1/blob/ls")
        return list(out["blobs"]), list(out["fetching"])

    return _run(d, online, lambda s: ([s.blob_info(c) for c in s.manifest_cids()], []))


def remove(d: Path, cid: str) -> int:
    from intellect_node.errors import TransportError
    from intellect_node.node import control

    def online() -> int:
        try:
            return int(control.request(d, "POST", "/v1/blob/rm", {"cid": cid})["freed"])
        except TransportError as exc:  # 404 not held, 409 being fetched: the node's words
            raise ConfigError(str(exc).split(": ", 1)[-1], field="cid") from exc

    return _run(d, online, lambda s: s.remove_blob(cid))


def collect(d: Path, keep: set[str], older_than: float) -> tuple[list[str], int, int]:
    from intellect_node.node import control

    def online() -> tuple[list[str], int, int]:
        out = control.request(d, "POST", "/v1/blob/gc", {"keep": sorted(keep), "older_than": older_than},
                              timeout=600)
        return list(out["removed"]), int(out["orphans"]), int(out["freed"])

    return _run(d, online, lambda s: s.gc(keep, older_than=older_than))


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _check_cid(cid: str) -> None:
    from intellect_node.protocol.ids import validate_cid

    try:
        validate_cid(cid)
    except ProtocolError as exc:
        raise ConfigError(f"CID {cid!r} is not a blob CID ({exc}); `intellect-node blob ls` lists them",
                          field="cid") from exc


def register(blob: typer.Typer) -> None:
    @blob.command("ls")
    def ls(
        data_dir_opt: Optional[Path] = DataDirOption,
        as_json: bool = typer.Option(False, "--json", help="One JSON object per blob, one a line."),
    ) -> None:
        """List the blobs held: CID, name, size, complete or partial, and what pins it."""
        d = data_dir(data_dir_opt)
        blobs, fetching = list_blobs(d)
        pinned = pins(d)
        now = time.time()
        total = 0
        for b in sorted(blobs, key=lambda b: b["since"]):
            b["pinned"] = pinned.get(b["cid"], "")
            b["fetching"] = b["cid"] in fetching
            total += int(b["held"])
            if as_json:
                typer.echo(json.dumps(b))
                continue
            state = "complete" if b["complete"] else f"partial {100 * b['held'] // max(1, b['size'])}%"
            if b["fetching"]:
                state += " (fetching)"
            age = now - float(b["since"])
            typer.echo(f"{b['cid']}  {human(b['size']):>10}  {state:<20}  {age / 3600:6.1f} h  "
                       f"{b['name']}" + (f"  [pinned: {b['pinned']}]" if b["pinned"] else ""))
        if not as_json:
            typer.echo(f"{len(blobs)} blob(s), {human(total)} held", err=True)

    @blob.command("rm")
    def rm(
        cids: list[str] = typer.Argument(..., help="Blob CID(s) to remove."),
        data_dir_opt: Optional[Path] = DataDirOption,
        force: bool = typer.Option(False, "--force", help="Remove a pinned blob too."),
    ) -> None:
        """Remove blobs from the store (their chunks too, unless another blob shares them)."""
        d = data_dir(data_dir_opt)
        for cid in cids:
            _check_cid(cid)
        pinned = pins(d)
        for cid in cids:
            if cid in pinned and not force:
                raise ConfigError(f"blob {cid} is pinned ({pinned[cid]}): peers fetch it from this node; "
                                  "--force removes it anyway", field="cid")
        for cid in cids:
            typer.echo(f"removed {cid} ({human(remove(d, cid))} freed)")

    @blob.command("gc")
    def gc(
        data_dir_opt: Optional[Path] = DataDirOption,
        min_age: float = typer.Option(GC_MIN_AGE_S, "--min-age", min=0.0,
                                      help="Keep blobs younger than this many seconds (default 3600)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
    ) -> None:
        """Remove the blobs this node no longer needs: not pinned (the trainer's current policy chain),
        older than --min-age, not being fetched; and chunks no blob lists."""
        d = data_dir(data_dir_opt)
        keep = set(pins(d))
        older_than = time.time() - min_age
        if dry_run:
            blobs, fetching = list_blobs(d)
            gone = [b for b in blobs if b["cid"] not in keep and b["cid"] not in fetching
                    and float(b["since"]) < older_than]
            for b in gone:
                typer.echo(f"would remove {b['cid']}  {human(b['held'])}  {b['name']}")
            typer.echo(f"{len(gone)} of {len(blobs)} blob(s), {human(sum(b['held'] for b in gone))}",
                       err=True)
            return
        removed, orphans, freed = collect(d, keep, older_than)
        for cid in removed:
            typer.echo(f"removed {cid}")
        typer.echo(f"removed {len(removed)} blob(s) and {orphans} orphan chunk(s): {human(freed)} freed; "
                   f"kept {len(keep)} pinned and everything younger than {min_age:.0f} s", err=True)
