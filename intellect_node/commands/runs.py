"""``intellect-node runs``, and what ``join --run`` does before its node starts.

``runs`` starts a short-lived swarm with a fresh key (``roles/runs.client_swarm``), dials the bootstrap
peers, asks every node that lists runs for its signed listing, fetches and checks each listed manifest
by its CID (in a temporary store), and prints one row per run.

``join --run CID`` (:func:`config_for_run`):

1. the node's own layers (``--config``, ``INTELLECT_NODE_*``, flags) are read; a shared ``[run]``/``[rl]``
   field among them is refused before anything else (it would make another run than the CID names);
2. ``--run`` names a CID, or a run ID looked up like ``runs`` does (refused, with the list, when it names
   several manifests, and without ``--organiser`` when the listings name several CIDs for it);
3. the manifest and the model files are taken from this data dir's blob store when complete there (the
   organiser's node, a restarted participant), else fetched by their CIDs through the swarm; the
   manifest must be signed by its blob's publisher (and by ``--organiser`` when given), every model file
   be the organiser's blob of the listed size, every chunk its hash;
4. the model folder goes to ``<data-dir>/runs/<cid>/model``, the thresholds to
   ``<data-dir>/runs/<cid>/proof_thresholds.json``, the manifest to ``<data-dir>/runs/<cid>.run`` (the
   node then lists and serves the run too), and the configuration is built from the manifest
   (``config/run_manifest.py``); the manifest's bootstrap addresses join the node's own.

The node is then built as any ``join`` builds it, so the memory check (``doctor``'s estimate against this
machine) refuses a role that does not fit before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import typer

from intellect_node.commands.common import BootstrapOption, DataDirOption, NodeConfigOption, data_dir
from intellect_node.errors import ConfigError, IntellectNodeError, ProtocolError, TransportError

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig
    from intellect_node.protocol.run_manifest import RunManifest
    from intellect_node.roles.runs import RunRow


class _ListedManifest(Protocol):
    @property
    def run_id(self) -> str: ...

    @property
    def organiser(self) -> str: ...

    @property
    def created_ms(self) -> int: ...


class Listed(Protocol):
    """What :func:`_pick_by_id` reads of a run ``find_runs`` found (``roles.runs.RunRow``)."""

    @property
    def cid(self) -> str: ...

    @property
    def manifest(self) -> _ListedManifest: ...


def _is_cid(text: str) -> bool:
    from intellect_node.protocol.ids import validate_cid

    try:
        validate_cid(text)
    except ProtocolError:
        return False
    return True


def _say(text: str) -> None:
    typer.echo(text, err=True)


async def _lookup(bootstrap: list[str], listen: str, wait_s: float) -> list[RunRow]:
    """Every run the swarm lists (``roles.runs.find_runs``), seen through a fresh key and a temporary
    store; ``wait_s``: also wait this long for listings on the runs topic."""
    from intellect_node.roles.runs import client_swarm, find_runs, listen_for_listings

    with tempfile.TemporaryDirectory(prefix="intellect-runs-") as tmp:
        async with client_swarm(bootstrap, listen=listen, data_dir=Path(tmp)) as (swarm, blobs):
            heard = await listen_for_listings(swarm)
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            return await find_runs(swarm, blobs, heard=heard)


def remembered_bootstrap(d: Path, limit: int = 8) -> list[str]:
    """Addresses of the peers the node of data dir ``d`` remembered (``peers.json``, newest first, each
    ending ``/p2p/<peer id>``): whom a command asks when no bootstrap address is given and no node runs."""
    from intellect_node.p2p.peerbook import PEERS_FILE, PeerBook

    if not (d / PEERS_FILE).exists():
        return []
    out = []
    for peer, addrs in PeerBook("", data_dir=d).remembered()[:limit]:
        if addrs:
            addr = addrs[0]
            out.append(addr if "/p2p/" in addr else f"{addr}/p2p/{peer}")
    return out


def _network_of(d: Path, bootstrap: list[str], config_file: Optional[Path]) -> tuple[list[str], str]:
    """``(--bootstrap, else the config's network.bootstrap, else the data dir's remembered peers; where to
    listen)``; ConfigError when there is no peer to ask."""
    from intellect_node.config.loader import load_config
    from intellect_node.roles.runs import lookup_listen

    flags = {"network": {"bootstrap": bootstrap}} if bootstrap else {}
    cfg = load_config(config_file, data_dir=d, flags=flags)
    addrs = list(cfg.network.bootstrap) or remembered_bootstrap(d)
    if not addrs:
        raise ConfigError("no peer to ask: give --bootstrap /ip4/<host>/tcp/<port>/p2p/<peer id> (a run's "
                          "organiser prints it), set network.bootstrap in the config, or start the node "
                          f"(`intellect-node join --data-dir {d}`) and ask it", field="--bootstrap")
    return addrs, lookup_listen(cfg.network.listen)


def _ask_running_node(d: Path, wait_s: float) -> list[dict[str, Any]] | None:
    """The runs the node running with ``d`` finds through its own swarm (``GET /v1/runs`` of its control
    API), or None when no node runs there (no control file, or it does not answer: a stale file)."""
    from intellect_node.node import control

    if not (d / control.CONTROL_FILE).exists():
        return None
    try:
        answer = control.request(d, "GET", f"/v1/runs?wait={wait_s:g}", timeout=120.0 + wait_s)
    except ConfigError:
        return None
    rows = answer.get("runs") if isinstance(answer, dict) else None
    if not isinstance(rows, list):
        raise TransportError(f"the node of --data-dir {d} answered /v1/runs without a list of runs")
    return rows


def _age(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h" if seconds < 172800 else f"{seconds // 86400}d"


def printable(text: str) -> str:
    """``text`` with every control and format character (C0/C1 escapes, bidi overrides, zero-width
    marks: Unicode categories Cc, Cf, and line and paragraph separators) as ``?``: what a manifest or a
    listing says is a peer's word and must not drive the operator's terminal."""
    import unicodedata

    return "".join("?" if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch for ch in text)


def render(rows: list[dict[str, Any]]) -> str:
    """The table ``runs`` prints (every cell through :func:`printable`)."""
    head = ["RUN", "MODEL", "ENV", "ORGANISER", "CID", "NODES", "VERSION", "STEP", "HELD-OUT", "AGE"]
    table = [head]
    for r in rows:
        nodes = " ".join(f"{k}={v}" for k, v in sorted(r["nodes"].items())) or "-"
        h = r.get("held_out")
        held = "-" if not h else f"{h['pass_rate']:.2f} v{h['version']} n={h['n']} by {h['evaluator'][-8:]}"
        table.append([printable(str(c)) for c in (
            r["run_id"], r["model"], r["env"], r["organiser"][-8:], r["cid"], nodes,
            str(r["policy_version"]) if r["policy_version"] >= 0 else "-",
            str(r["step"]) if r["step"] >= 0 else "-", held, _age(r["age_s"]))])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def register(app: typer.Typer) -> None:
    @app.command("runs")
    def runs(
        bootstrap: list[str] = BootstrapOption,
        data_dir_opt: Optional[Path] = DataDirOption,
        config_file: Optional[Path] = NodeConfigOption,
        as_json: bool = typer.Option(False, "--json", help="One JSON object per run, in a list."),
        wait_s: float = typer.Option(0.0, "--wait", help="Also listen this many seconds for run listings "
                                                         "on the runs gossip topic."),
    ) -> None:
        """List the runs the swarm announces: run ID, model, environment, organiser, manifest CID, nodes
        seen per role, newest policy version and step, newest held-out result, age.

        The held-out result is a validator's (pass rate, version, problems, evaluator), where a validator
        of the run evaluates. Without --bootstrap, a node running with
        --data-dir is asked (through its own peers); with none running, the config's bootstrap peers or
        the data dir's remembered peers. Exit 1 when no peer answers."""
        d = data_dir(data_dir_opt)
        try:
            out = None if bootstrap else _ask_running_node(d, wait_s)
            if out is None:
                addrs, listen = _network_of(d, list(bootstrap), config_file)
                now = int(time.time() * 1000)
                out = [r.to_json(now) for r in asyncio.run(_lookup(addrs, listen, wait_s))]
        except ConfigError:
            raise
        except IntellectNodeError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from exc
        if as_json:
            typer.echo(json.dumps(out, indent=2))
        elif not out:
            typer.echo("no runs listed by the peers reached")
        else:
            typer.echo(render(out))


# -- join --run ------------------------------------------------------------------------------------


def _held(d: Path, run_ref: str) -> list[str]:
    """CIDs of the runs in this data dir that ``run_ref`` (a CID or a run ID) names."""
    from intellect_node.roles.runs import held_runs

    held = held_runs(d)
    return [cid for cid, m in held.items() if run_ref in (cid, m.run_id)]


def _pick(run_ref: str, candidates: list[tuple[str, str, str]]) -> str:
    """The one CID among ``(cid, organiser, age)`` that ``run_ref`` names; ConfigError otherwise."""
    if not candidates:
        raise ConfigError(f"--run {run_ref}: no run with that ID is listed by the peers reached; "
                          "`intellect-node runs` shows the runs, or pass the run's CID", field="--run")
    if len({c for c, _o, _a in candidates}) > 1:
        listing = "; ".join(f"{c} (organiser {o}, {a} old)" for c, o, a in candidates)
        raise ConfigError(f"--run {run_ref} names {len(candidates)} runs: {listing}; pass the CID of the "
                          "one to join (and --organiser to pin who made it)", field="--run")
    return candidates[0][0]


def _pick_by_id(run_ref: str, organiser: Optional[str], rows: Sequence[Listed], claims: dict[str, set[str]],
                now_ms: int) -> str:
    """The CID that run ID ``run_ref`` names among the rows ``find_runs`` found. Without ``--organiser``
    every listing must name the same CID for it: a listing is one node's word, and a hostile one may name
    its own manifest of that run ID (with the honest one left out of the lookup's limits). ConfigError
    naming --organiser when they disagree."""
    named = sorted(claims.get(run_ref, set()))
    if organiser is None and len(named) > 1:
        raise ConfigError(f"--run {run_ref}: the peers' listings name {len(named)} manifests for that run "
                          f"ID ({', '.join(named[:8])}); pass --organiser <peer id> to pin who made the "
                          "run, or --run <CID>", field="--organiser")
    found = [r for r in rows if r.manifest.run_id == run_ref
             and (organiser is None or r.manifest.organiser == organiser)]
    return _pick(run_ref, [(r.cid, r.manifest.organiser,
                            _age(max(0, (now_ms - r.manifest.created_ms) // 1000))) for r in found])


async def _prepare(d: Path, run_ref: str, organiser: Optional[str], bootstrap: list[str],
                   listen: str) -> tuple[str, RunManifest]:
    """The run's CID and manifest, with its model folder and thresholds written under
    ``<data-dir>/runs/<cid>/`` (see the module docstring)."""
    from intellect_node.blobs.service import BLOBS_DIR, BlobService
    from intellect_node.blobs.store import BlobStore
    from intellect_node.protocol.signing import SigningKey
    from intellect_node.roles.runs import (
        client_swarm,
        fetch_model,
        fetch_run,
        find_runs,
        keep_run,
        run_folder,
    )

    cid = run_ref if _is_cid(run_ref) else None
    if cid is None:
        local = _held(d, run_ref)
        if len(local) == 1:
            cid = local[0]
    if cid is not None:  # from the store when everything is there
        local_blobs = BlobService(BlobStore(d / BLOBS_DIR), SigningKey.generate())
        await local_blobs.start(announce=False)
        try:
            if local_blobs.store.manifest(cid) is not None and not local_blobs.store.missing(cid):
                run, raw = await fetch_run(local_blobs, cid, organiser=organiser)
                store = local_blobs.store
                if all(store.manifest(f.blob) is not None and not store.missing(f.blob)
                       for f in run.model_files):
                    await fetch_model(local_blobs, run, run_folder(d, cid) / "model")
                    keep_run(d, cid, raw)
                    return cid, run
        finally:
            await local_blobs.close()
    if not bootstrap:
        raise ConfigError(f"--run {run_ref}: the run is not held in {d}, and there is no peer to fetch it "
                          "from; give --bootstrap /ip4/<host>/tcp/<port>/p2p/<peer id>", field="--bootstrap")
    async with client_swarm(bootstrap, listen=listen, data_dir=d) as (_swarm, blobs):
        if cid is None:
            _say(f"looking up run {run_ref} ...")
            claims: dict[str, set[str]] = {}
            rows = await find_runs(_swarm, blobs, claims=claims)
            cid = _pick_by_id(run_ref, organiser, rows, claims, int(time.time() * 1000))
        _say(f"fetching run {cid} ...")
        run, raw = await fetch_run(blobs, cid, organiser=organiser)
        _say(f"run {printable(run.run_id)} by {run.organiser}: fetching {len(run.model_files)} model files "
             f"({run.model_bytes} bytes) by their CIDs ...")
        await fetch_model(blobs, run, run_folder(d, cid) / "model")
        keep_run(d, cid, raw)
    return cid, run


def config_for_run(run_ref: str, organiser: Optional[str], d: Path, *, flags: Mapping[str, object],
                   config_file: Optional[Path], flag_names: dict[str, str]) -> NodeConfig:
    """The node configuration of ``join --run`` (module docstring); ``flag_names``: join's flag of each
    field, for errors. ConfigError for the operator's mistakes (exit 2); ProtocolError, TransportError
    or IntegrityError when the run cannot be had."""
    from intellect_node.config.loader import build_config, config_layers
    from intellect_node.config.run_manifest import config_from_manifest, shared_fields_set
    from intellect_node.fsutil import atomic_write_text
    from intellect_node.p2p import identity
    from intellect_node.protocol.ids import public_key_from_peer_id
    from intellect_node.roles.runs import lookup_listen, run_folder

    if organiser is not None:
        try:
            public_key_from_peer_id(organiser)
        except ProtocolError as exc:
            raise ConfigError(f"--organiser {organiser!r} is not a peer ID (12D3KooW...)",
                              field="--organiser") from exc
    _file, local, origin = config_layers(config_file, flags=flags, data_dir=d, flag_names=flag_names)
    clash = shared_fields_set(local, origin)
    if clash:
        field, where = clash[0]
        raise ConfigError(f"{field} (set in {where}) comes from the run manifest when joining with --run; "
                          "drop it from your config, flags and environment", field=field)
    own = build_config({k: v for k, v in local.items() if k not in ("run", "rl")})
    identity.ensure_data_dir(d)
    ask = list(own.network.bootstrap) or remembered_bootstrap(d)
    cid, run = asyncio.run(_prepare(d, run_ref, organiser, ask, lookup_listen(own.network.listen)))
    folder = run_folder(d, cid)
    thresholds = folder / "proof_thresholds.json"
    atomic_write_text(thresholds, run.thresholds)
    me = identity.load_key(d).peer_id if identity.key_path(d).exists() else None
    # The manifest's addresses join the node's own, except for this node itself and for peers the
    # operator gave an address of: libp2p dials a peer's addresses at once, and one that fails (an
    # organiser's address from before a move) puts the peer in its negative dial cache for a minute.
    given = {a.rsplit("/p2p/", 1)[-1] for a in own.network.bootstrap}
    boot = [*own.network.bootstrap, *(a for a in run.bootstrap
                                      if a.rsplit("/p2p/", 1)[-1] not in given | {me})]
    network = local.get("network")
    local = {**local, "network": {**(network if isinstance(network, Mapping) else {}), "bootstrap": boot}}
    cfg = config_from_manifest(run, local=local, origin=origin, model_dir=folder / "model",
                               thresholds=thresholds)
    _say(f"joining run {printable(run.run_id)} ({cid}) organised by {run.organiser}")
    return cfg


def fail(exc: BaseException) -> None:
    """Print a refused run's reason and exit 1 (the run, not the operator's input, is wrong)."""
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    sys.exit(1)
