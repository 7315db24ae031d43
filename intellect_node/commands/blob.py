"""``intellect-node blob``: publish a file as a content-addressed blob, fetch one through the swarm.

``put`` goes through the running node (which then serves the chunks and announces the blob in the DHT);
with no node running it stores the blob in the data dir, and the node announces it when it starts.
``get`` always goes through the running node: it finds providers in the DHT, pulls chunks from several
in parallel and writes the file; the CLI only renders the node's progress stream.

Both show progress (``commands/progress.py``: a bar on a terminal, JSON lines on stderr otherwise): ``put``
while the file is cut and hashed and while its provider record goes out, ``get`` while chunks arrive and
then while ``--out`` is assembled and synced to disk (seconds of its own for a large file).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError, ProtocolError, TransportError

MIB = 1024 * 1024


def _stream(data_dir_: Path, path: str, body: Mapping[str, object]) -> Iterator[dict[str, Any]]:
    """POST to the node's control API and yield the JSON lines it streams back."""
    from intellect_node.node import control

    url, token = control.read_control_file(data_dir_)
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        # The read timeout bounds the silence between two progress lines, not the whole download.
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.strip():
                    yield json.loads(line)
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode("utf-8", "replace")
        raise TransportError(f"node answered {exc.code}: {detail}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise TransportError(f"lost the node at {url}: {exc}") from exc


def register(app: typer.Typer) -> None:
    blob = typer.Typer(help="Content-addressed blobs (checkpoints, batches): publish and fetch by CID.",
                       no_args_is_help=True)

    @blob.command("put")
    def put(
        file: Path = typer.Argument(..., help="File to publish."),
        data_dir_opt: Optional[Path] = DataDirOption,
        name: Optional[str] = typer.Option(None, "--name", help="Name recorded in the manifest (default: "
                                                                "the file name)."),
        chunk_mib: float = typer.Option(3.0, "--chunk-mib", help="Chunk size in MiB (default 3)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
    ) -> None:
        """Chunk FILE, sign its manifest and print the blob CID."""
        from intellect_node.commands.progress import Progress
        from intellect_node.node import control

        d = data_dir(data_dir_opt)
        src = file.expanduser().resolve()
        if not src.is_file():
            raise ConfigError(f"FILE {file} is not a readable file; pass the path of the file to publish",
                              field="file")
        chunk_size = int(chunk_mib * MIB)
        if (d / control.CONTROL_FILE).exists():
            final: dict[str, Any] = {}
            try:
                with Progress("blob put", quiet=quiet) as progress:
                    progress.phase("chunking", total=src.stat().st_size, unit="bytes", file=str(src))
                    for ev in _stream(d, "/v1/blob/put", {"path": str(src), "name": name,
                                                          "chunk_size": chunk_size, "progress": True}):
                        if ev.get("event") == "chunking":
                            progress.update(ev["bytes_done"], total=ev["bytes_total"])
                        elif ev.get("event") == "announcing":
                            progress.phase("announcing in the DHT")
                        else:
                            final = ev
                    if final.get("event") != "done":
                        progress.finish("failed")
            except TransportError as exc:
                raise ConfigError(f"the node refused the file: {exc}", field="file") from exc
            if final.get("event") != "done":
                raise ConfigError(f"the node refused the file: {final.get('message', 'no answer')}",
                                  field="file")
            typer.echo(final["cid"])
            return
        from intellect_node.blobs.service import BLOBS_DIR
        from intellect_node.blobs.store import BlobStore
        from intellect_node.commands.common import data_dir_lock
        from intellect_node.p2p.identity import load_key

        key = load_key(d)
        with data_dir_lock(d), Progress("blob put", quiet=quiet) as progress:
            progress.phase("chunking", total=src.stat().st_size, unit="bytes", file=str(src))
            cid, _m = BlobStore(d / BLOBS_DIR).add_file(
                src, key, name=name, chunk_size=chunk_size,
                on_bytes=lambda done, total: progress.update(done, total=total))
        typer.echo(f"no node running with --data-dir {d}: stored locally; it is announced when "
                   "`intellect-node join` starts", err=True)
        typer.echo(cid)

    @blob.command("get")
    def get(
        cid: str = typer.Argument(..., help="Blob CID (bafkrei...) as printed by `blob put`."),
        out: Path = typer.Option(..., "--out", "-o", help="Where to write the file."),
        data_dir_opt: Optional[Path] = DataDirOption,
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
        no_keep: bool = typer.Option(False, "--no-keep",
                                     help="Drop the blob from the node's store once --out is written (it "
                                          "then costs its size once, not twice; this node stops serving "
                                          "it). A blob held before, or pinned, is kept."),
    ) -> None:
        """Fetch blob CID through the running node (DHT providers, parallel chunks) into --out."""
        from intellect_node.commands.progress import Progress
        from intellect_node.protocol.ids import validate_cid

        try:
            validate_cid(cid)
        except ProtocolError as exc:
            raise ConfigError(f"CID {cid!r} is not a blob CID ({exc}); use the CID `blob put` printed",
                              field="cid") from exc
        d = data_dir(data_dir_opt)
        dst = out.expanduser().resolve()
        if dst.is_dir():
            raise ConfigError(f"--out {out} is a directory; give a file path", field="out")
        final: dict[str, Any] = {}
        if no_keep:
            from intellect_node.commands import blob_store
            from intellect_node.node import control

            control.read_control_file(d)  # get needs the node: say so before asking it anything
            held_before = any(b["cid"] == cid for b in blob_store.list_blobs(d)[0])
        with Progress("blob get", quiet=quiet) as progress:
            progress.phase("finding providers", cid=cid)
            for ev in _stream(d, "/v1/blob/get", {"cid": cid, "out": str(dst)}):
                kind = ev.get("event")
                if kind == "manifest":
                    progress.phase("fetching", total=ev["bytes_total"], done=ev["bytes_done"], unit="bytes",
                                   name=str(ev.get("name", ""))[:40])
                elif kind == "chunk":
                    progress.update(ev["bytes_done"])
                elif kind == "writing" and ev["bytes_done"] == ev["bytes_total"]:
                    progress.phase("syncing to disk", out=str(dst))  # the fsync: seconds when large
                elif kind == "writing":
                    if progress.phase_name != "writing":
                        progress.phase("writing", total=ev["bytes_total"], unit="bytes", out=str(dst))
                    progress.update(ev["bytes_done"])
                elif kind in ("done", "error"):
                    final = ev
            if final.get("event") != "done":
                progress.finish("failed")
        if final.get("event") != "done":
            typer.secho(f"error: {final.get('message', 'the node stopped answering')}", fg=typer.colors.RED,
                        err=True)
            raise typer.Exit(1)
        typer.echo(f"{dst}  ({final['chunks_fetched']} chunks fetched, {final['chunks_resumed']} "
                   f"already here, {final['seconds']}s)")
        if no_keep and not held_before and cid not in blob_store.pins(d):
            freed = blob_store.remove(d, cid)
            typer.echo(f"dropped {cid} from the store ({blob_store.human(freed)} freed)", err=True)

    from intellect_node.commands import blob_store

    blob_store.register(blob)  # ls, rm, gc
    app.add_typer(blob, name="blob")
