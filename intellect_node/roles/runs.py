"""Runs a node lists and serves, and the client side: finding runs and fetching one by its CID.

Parts (wired by ``node/assembly.py`` for the service, by ``commands/runs.py`` and ``commands/join.py``
for the client):

- :class:`RunsService`, one per joined node: the runs held in ``<data-dir>/runs/`` (``<cid>.run``: the
  signed run manifest, whose blob is in the node's store; written by ``run init`` and by ``join --run``).
  When it holds any it provides :data:`RUNS_KEY` in the DHT, answers ``GET /runs/v1`` with its signed
  :class:`RunListing`, and publishes the listing on :data:`RUNS_TOPIC` every :data:`LISTING_INTERVAL_S`
  (relaying other holders' listings there); a node holding none stays off the topic.
  The blob service announces the manifest and model blobs themselves, as every blob it holds.
- :func:`find_runs`: asks every provider of :data:`RUNS_KEY` for its listing (HTTP, the address rules
  of ``blobs/addresses.py``), adds the listings heard on the gossip topic, fetches each listed manifest
  by its CID and checks it (a listing is a node's word; only the manifest behind the CID is the
  organiser's).
- :func:`fetch_run` and :func:`fetch_model`: the manifest by CID (blob publisher = signer = organiser,
  ``--organiser`` when given), then every model file by its blob CID (publisher and size checked; every
  chunk is hash-checked by the fetcher) into a folder.
- ``GET /v1/runs`` on the node's control API (:meth:`RunsService.control_routes`): the same lookup
  through the running node's own swarm, for ``intellect-node runs --data-dir D`` beside a running node.
- :func:`client_swarm`: a short-lived swarm with a fresh key for the commands that look before a node
  runs (``runs``, ``join --run`` before it builds the node's configuration). It runs the client side of
  the NAT service (``p2p/nat``: circuit dialling, DCUtR, the libp2p chunk stream), so files held only by
  nodes behind NAT (``p2p://`` providers) come through their relays; it needs no AutoNAT verdict or
  relay reservation of its own, since a lookup only dials out (a lookup behind NAT included).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import msgspec
from aiohttp import ClientError, ClientSession, ClientTimeout, web

from intellect_node.blobs.addresses import AddressPolicy
from intellect_node.blobs.service import BlobService
from intellect_node.config import NodeConfig
from intellect_node.config.nat import NatConfig
from intellect_node.config.status import StatusBoard
from intellect_node.errors import (
    ConfigError,
    IntellectNodeError,
    MessageIgnored,
    ProtocolError,
    TransportError,
)
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.p2p.nat.service import NatService
from intellect_node.p2p.swarm import Provider, Swarm
from intellect_node.protocol.blob import Manifest
from intellect_node.protocol.feed import FEED_HTTP_PATH, MAX_FEED_BYTES, RunFeed, open_feed
from intellect_node.protocol.run_manifest import (
    MAX_LISTED_RUNS,
    MAX_LISTING_BYTES,
    MAX_RUN_ENVELOPE_BYTES,
    RUNS_HTTP_PATH,
    RUNS_KEY,
    RUNS_TOPIC,
    HeldOutSeen,
    ModelFile,
    RunListing,
    RunManifest,
    RunSeen,
    check_model_blob,
    check_run_blob,
    open_listing,
    open_run_manifest,
    seal_listing,
)
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common import pins
from intellect_node.roles.common.seams import LoopFactory

log = logging.getLogger(__name__)
S = TypeVar("S")

RUNS_DIR = pins.RUNS_DIR
LISTING_INTERVAL_S = 30.0
"""How often a node holding runs publishes its listing on the runs topic."""
LISTING_TIMEOUT_S = 5.0
"""Deadline of one ``GET /runs/v1``."""
MAX_PROVIDERS_ASKED = 20
MAX_RUNS_LOOKED_AT = 64
"""Distinct run CIDs one lookup fetches the manifests of (listings name at most 32 each)."""
RUNS_CONTROL_PATH = "/v1/runs"
MAX_CONTROL_WAIT_S = 120.0
"""The longest ``?wait=`` the control route honours (``runs --wait`` through a running node)."""
MANIFEST_TIMEOUT_S = 15.0
"""Deadline of one listed manifest's fetch: a listing naming CIDs nobody serves costs a lookup this long
at most, since the manifests are fetched at once."""


def run_file(data_dir: Path, cid: str) -> Path:
    return data_dir / RUNS_DIR / f"{cid}.run"


def run_folder(data_dir: Path, cid: str) -> Path:
    """Where ``join --run`` keeps run ``cid``'s model folder and thresholds file."""
    return data_dir / RUNS_DIR / cid


def held_runs(data_dir: Path) -> dict[str, RunManifest]:
    """The runs in ``<data-dir>/runs/`` whose manifest opens (a damaged file is logged and left out)."""
    held = pins.held_runs(data_dir)
    folder = data_dir / RUNS_DIR
    for path in sorted(folder.glob("*.run")) if folder.is_dir() else []:
        if path.stem not in held:
            log.warning("run manifest %s left out: it does not open as a run manifest", path)
    return held


# -- the service -----------------------------------------------------------------------------------


class RunsRuntime(Protocol):
    """What the runs service uses of the node (``node.runtime.NodeRuntime``). Not the roles' ``Runtime``:
    a listing counts the peers of each role, which needs the whole swarm facade (its peerbook's records,
    this node's roles), not the slice an RL role sees."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def board(self) -> StatusBoard: ...

    @property
    def swarm(self) -> Swarm: ...

    @property
    def data_dir(self) -> Path: ...

    def service(self, kind: type[S]) -> S | None: ...

    def spawn(self, name: str, factory: LoopFactory, *, essential: bool = True,
              may_end: bool = False) -> asyncio.Task[None]: ...


class RunsService:
    """Serves and announces the runs this node holds (module docstring). ``status()`` under ``runs``."""

    name = "runs"

    def __init__(self, runtime: RunsRuntime, blobs: BlobService) -> None:
        self._rt = runtime
        self._blobs = blobs
        self.runs: dict[str, RunManifest] = {}
        self.heard: dict[str, RunListing] = {}
        """Listings heard on the runs topic, newest per node (bounded by :data:`MAX_HEARD`)."""
        self._task: asyncio.Task[None] | None = None

    MAX_HEARD = 256

    @classmethod
    def for_runtime(cls, rt: RunsRuntime) -> "RunsService":
        blobs = rt.service(BlobService)
        if blobs is None:
            raise ConfigError("the runs service needs the blob service; add it first", field="services")
        return cls(rt, blobs)

    async def start(self) -> None:
        held = await asyncio.to_thread(held_runs, self._rt.data_dir)
        store = self._blobs.store
        for cid, m in held.items():
            blob = store.manifest(cid)
            if blob is None or store.missing(cid):
                log.warning("run %s (%s) is not complete in the blob store; not listed", cid, m.run_id)
                continue
            try:
                check_run_blob(blob, m)
            except ProtocolError as exc:
                log.warning("run %s not listed: %s", cid, exc)
                continue
            self.runs[cid] = m
        if self.runs:  # a node holding no run keeps out of the topic: no mesh to maintain for it
            log.info("listing runs %s", ", ".join(f"{m.run_id} ({cid})" for cid, m in self.runs.items()))
            self._rt.swarm.subscribe(RUNS_TOPIC, self._validate, self._heard)
            # Not essential: a node whose listing fails keeps training and serving (restarted meanwhile).
            self._task = self._rt.spawn("runs-listing", self._announce_loop, essential=False)

    async def close(self) -> None:
        if self._task is not None:
            from intellect_node.aioutil import cancel_and_wait

            await cancel_and_wait([self._task])

    def _validate(self, data: bytes, origin: str) -> RunListing:
        return open_listing(data, now_ms=int(time.time() * 1000), signer=origin)

    def _heard(self, listing: RunListing, origin: str) -> None:
        self.heard.pop(origin, None)
        self.heard[origin] = listing
        while len(self.heard) > self.MAX_HEARD:
            self.heard.pop(next(iter(self.heard)))

    async def _announce_loop(self) -> None:
        swarm = self._rt.swarm
        await swarm.provide(RUNS_KEY)
        while True:
            await swarm.publish(RUNS_TOPIC, self.sealed_listing())
            await asyncio.sleep(LISTING_INTERVAL_S)

    def listing(self) -> RunListing:
        """What this node sees of each run it holds: its run's nodes per role (this node included), the
        newest policy version and trainer step it knows. Other runs get no counts: heartbeats, which
        carry the roles, come only on this node's own run's topic (docs/architecture.md, "Runs"); the
        nodes of those runs list them with theirs."""
        snap = self._rt.board.snapshot()
        swarm = self._rt.swarm
        mine = self._rt.config.run.run_id
        counts: dict[str, int] = {}
        seen = [(r["state"], r["roles"]) for r in swarm.peerbook.snapshot()]
        for state, roles in [*seen, ("alive", swarm.roles)]:
            if state == "alive":
                for role in (roles or ["node"])[:8]:
                    counts[str(role)[:32]] = counts.get(str(role)[:32], 0) + 1
        nodes = dict(list(counts.items())[:8])
        version, step = max(-1, snap.policy.current), max(-1, snap.training.step)
        h = snap.held_out
        held = HeldOutSeen(version=h.version, n=h.n, pass_rate=h.pass_rate, mean_reward=h.mean_reward,
                           evaluator=h.evaluator) if h.version >= 0 and h.evaluator else None
        runs = [RunSeen(cid=cid, run_id=m.run_id, nodes=nodes, policy_version=version, step=step,
                        held_out=held)
                if m.run_id == mine else RunSeen(cid=cid, run_id=m.run_id, nodes={})
                for cid, m in list(self.runs.items())[-MAX_LISTED_RUNS:]]
        return RunListing(node=swarm.peer_id, time_ms=int(time.time() * 1000), runs=runs)

    def sealed_listing(self) -> bytes:
        return seal_listing(self._rt.swarm.key, self.listing())

    def routes(self) -> list[web.RouteDef]:
        async def get(_request: web.Request) -> web.StreamResponse:
            if not self.runs:
                return web.Response(status=404, text="no runs held here")
            return web.Response(body=self.sealed_listing(), content_type="application/octet-stream")

        return [web.get(RUNS_HTTP_PATH, get)]

    def control_routes(self) -> list[web.RouteDef]:
        """``GET /v1/runs[?wait=S]`` on the control API: :func:`find_runs` through this node's own swarm
        (its peers, its DHT, the listings it heard, its own), as the ``runs`` command prints them; how the
        CLI uses the node that is running instead of a lookup of its own (``intellect-node runs``)."""

        async def get(request: web.Request) -> web.StreamResponse:
            try:
                wait_s = min(MAX_CONTROL_WAIT_S, max(0.0, float(request.query.get("wait", "0"))))
            except ValueError:
                return web.json_response({"error": "wait must be a number of seconds"}, status=400)
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            own = [self.listing()] if self.runs else []
            rows = await find_runs(self._rt.swarm, self._blobs, heard=[*self.heard.values(), *own])
            now = int(time.time() * 1000)
            return web.json_response({"runs": [r.to_json(now) for r in rows]})

        return [web.get(RUNS_CONTROL_PATH, get)]

    def status(self) -> dict[str, object]:
        return {"runs": [{"cid": cid, "run_id": m.run_id, "model": m.model_name, "env": m.env,
                          "organiser": m.organiser} for cid, m in self.runs.items()],
                "heard": len(self.heard)}


# -- the client side -------------------------------------------------------------------------------


def lookup_listen(listen: Sequence[str]) -> str:
    """Where a lookup swarm listens: the node's first listen address on any free port. The address kind
    matters: a node fetches from a peer's private (LAN) address only when it has one of that kind itself
    (``blobs/addresses.py``), so a lookup on loopback could not fetch from a run's organiser on the LAN."""
    first = listen[0] if listen else "/ip4/127.0.0.1/tcp/0"
    parts = first.split("/")
    if len(parts) >= 5 and parts[3] == "tcp":
        parts[4] = "0"
    return "/".join(parts)


@asynccontextmanager
async def client_swarm(bootstrap: Sequence[str], *, listen: str = "/ip4/127.0.0.1/tcp/0",
                       data_dir: Path, timeout: float = 60.0) -> AsyncIterator[tuple[Swarm, BlobService]]:
    """A swarm with a fresh key (a lookup is nobody's identity) dialled to ``bootstrap``, and a blob
    service on ``<data_dir>/blobs`` (what is fetched stays there for the node that runs next).
    TransportError when no bootstrap peer answers within ``timeout`` seconds (dialled again meanwhile)."""
    swarm = await Swarm.start(SigningKey.generate(), run_id="default", listen=[listen], roles=[])
    # A lookup dials whatever the DHT names, nodes long gone included: libp2p's dial errors are noise
    # to the command's user (a node started afterwards sets the level again, p2p.swarm).
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    # A run's files may be held only by nodes behind NAT (an organiser publishing from home, participants
    # once the organiser left): they advertise ``p2p://`` and serve over the libp2p chunk stream through
    # their relays. The lookup only dials out, so it runs the NAT service's client side alone.
    nat = NatService(swarm, NatConfig(), client_only=True)
    blobs = BlobService.from_swarm(swarm, data_dir, extra_sources=[nat.source])
    try:
        await nat.start()
        if not bootstrap:
            raise TransportError("no bootstrap address: give --bootstrap /ip4/.../tcp/.../p2p/<peer id>")
        deadline = time.monotonic() + timeout
        wait = 0.5
        while not (reached := await swarm.bootstrap(list(bootstrap), remember=False)):
            # Nodes started together (the demo, a compose file): the organiser may be a moment behind.
            if time.monotonic() + wait > deadline:
                raise TransportError(f"no bootstrap peer answered in {timeout:.0f} s "
                                     f"({', '.join(bootstrap)})")
            await asyncio.sleep(wait)
            wait = min(4.0, wait * 2)
        log.info("looking up runs through %d bootstrap peers", len(reached))
        await blobs.start(announce=False)
        yield swarm, blobs
    finally:
        await blobs.close()
        await nat.close()
        await swarm.close()


async def fetch_run(blobs: BlobService, cid: str, *,
                    organiser: str | None = None) -> tuple[RunManifest, bytes]:
    """Run ``cid``'s manifest and its signed bytes, fetched by its CID (or held already) and checked;
    ProtocolError when it is not a run manifest, is not signed by its blob's publisher, or not by
    ``organiser``; TransportError when no provider serves it."""
    blob: list[Manifest] = []

    def seen(m: Manifest) -> None:
        if m.total_size > MAX_RUN_ENVELOPE_BYTES:
            raise ProtocolError(f"blob {cid} holds {m.total_size} bytes: not a run manifest")
        if organiser is not None and m.publisher != organiser:
            raise ProtocolError(f"run {cid} is published by {m.publisher}, not by the organiser {organiser}")
        blob.append(m)

    store = blobs.store
    if store.manifest(cid) is None or store.missing(cid):
        await blobs.fetch(cid, on_manifest=seen)
    held = store.manifest(cid)
    if held is None:
        raise TransportError(f"run {cid} was not fetched")
    if not blob:  # held from before: the same checks
        seen(held)
    raw = bytes(await asyncio.to_thread(store.read, cid))
    try:
        run = open_run_manifest(raw, organiser=organiser)
        check_run_blob(held, run)
    except ProtocolError as exc:
        raise ProtocolError(f"run {cid} is refused: {exc}") from exc
    return run, raw


async def fetch_model(blobs: BlobService, run: RunManifest, out: Path) -> Path:
    """Every model file of ``run`` fetched by its blob CID into the folder ``out``, all at once (kept
    when complete: a restarted join fetches nothing). ProtocolError for a blob that is not the
    organiser's file; TransportError when no provider serves one."""
    out.mkdir(parents=True, exist_ok=True)

    async def one(f: ModelFile) -> None:
        dest = out / f.path
        held = blobs.store.manifest(f.blob)
        complete = held is not None and not blobs.store.missing(f.blob)
        if held is not None:
            check_model_blob(held, run, f)
        if complete and dest.is_file() and dest.stat().st_size == f.size:
            return
        log.info("fetching %s of run %s (%d bytes)", f.path, run.run_id, f.size)
        await blobs.fetch(f.blob, out=dest, on_manifest=lambda m: check_model_blob(m, run, f))

    try:
        async with asyncio.TaskGroup() as group:  # one file failing ends the others' fetches too
            for f in run.model_files:
                group.create_task(one(f))
    except* IntellectNodeError as failed:
        raise failed.exceptions[0] from None
    return out


@dataclass
class RunRow:
    """One run as ``intellect-node runs`` shows it."""

    cid: str
    manifest: RunManifest
    nodes: dict[str, int] = field(default_factory=dict)
    policy_version: int = -1
    step: int = -1
    listed_by: list[str] = field(default_factory=list)
    held_out: HeldOutSeen | None = None
    """The newest held-out result listed: of the highest version, one by a validator the run names
    (``run.validator_peer_ids``) over another node's; a listing node's word (see :class:`HeldOutSeen`)."""

    def to_json(self, now_ms: int) -> dict[str, object]:
        m = self.manifest
        return {"run_id": m.run_id, "model": m.model_name, "env": m.env, "organiser": m.organiser,
                "cid": self.cid, "nodes": self.nodes, "policy_version": self.policy_version,
                "step": self.step, "age_s": max(0, (now_ms - m.created_ms) // 1000),
                "model_bytes": m.model_bytes, "bootstrap": m.bootstrap, "listed_by": self.listed_by,
                "held_out": None if self.held_out is None else msgspec.structs.asdict(self.held_out)}


async def _get_listing(policy: AddressPolicy, provider: Provider) -> RunListing:
    """A provider's signed listing over HTTP, sent only to an address that is the provider's own."""
    body = await get_from_provider(policy, provider, RUNS_HTTP_PATH, MAX_LISTING_BYTES + 1024)
    return open_listing(body, now_ms=int(time.time() * 1000), signer=provider.peer_id)


async def get_from_provider(policy: AddressPolicy, provider: Provider, path: str, max_bytes: int, *,
                            timeout: float = LISTING_TIMEOUT_S) -> bytes:
    """``GET path`` of a provider's bulk HTTP server, at most ``max_bytes`` read, sent only to an address
    that is the provider's own (``AddressPolicy``); TransportError for anything but a 200."""
    parts = urlsplit(provider.http_url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise TransportError(f"provider URL {provider.http_url[:80]!r} is not a plain http://host:port URL")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port)
    except (OSError, UnicodeError) as exc:  # socket.gaierror: a name nobody resolves is a provider's word
        raise TransportError(f"cannot resolve {parts.hostname[:80]!r}: {exc}") from exc
    if not infos:
        raise TransportError(f"cannot resolve {parts.hostname}")
    ip = str(infos[0][4][0])
    why = policy.refusal(provider.peer_id, ip)
    if why:
        raise TransportError(why)
    host = f"[{ip}]" if ":" in ip else ip
    url = f"http://{host}:{parts.port}{parts.path.rstrip('/')}{path}"
    try:
        async with ClientSession(timeout=ClientTimeout(total=timeout)) as session:
            async with session.get(url, headers={"Host": parts.netloc}) as resp:
                if resp.status != 200:
                    raise TransportError(f"{url}: HTTP {resp.status}")
                return await resp.content.read(max_bytes)
    except (ClientError, asyncio.TimeoutError) as exc:
        raise TransportError(f"{url}: {exc!r}") from exc


async def run_feeds(swarm: Swarm, run: RunManifest) -> tuple[list[RunFeed], list[str]]:
    """The signed feeds (``protocol/feed.py``) of the run's trainer and validators among the providers
    of :data:`RUNS_KEY`, and a line for each that could not be had. A feed that is not its signer's,
    not of this run or out of bounds is recorded against the provider."""
    shared = run.config_dict().get("run") or {}
    trusted = {str(shared.get("trainer_peer_id") or run.organiser),
               *(str(v) for v in shared.get("validator_peer_ids") or [])}
    providers = [p for p in (await swarm.find_providers(RUNS_KEY))[:MAX_PROVIDERS_ASKED]
                 if p.peer_id in trusted]
    policy = AddressPolicy.from_swarm(swarm)
    notes: list[str] = []

    async def ask(p: Provider) -> RunFeed | None:
        try:
            body = await get_from_provider(policy, p, FEED_HTTP_PATH, MAX_FEED_BYTES + 1, timeout=60.0)
            return open_feed(body, now_ms=int(time.time() * 1000), signer=p.peer_id, run_id=run.run_id)
        except MessageIgnored as exc:  # a stamp off our clock: a clock apart is no misbehaviour
            notes.append(f"the feed of {p.peer_id} was left out: {exc}")
        except ProtocolError as exc:
            swarm.peerbook.record_rejection(p.peer_id, f"run feed: {exc}")
            notes.append(f"the feed of {p.peer_id} was refused: {exc}")
        except (IntellectNodeError, OSError, ValueError) as exc:
            notes.append(f"no feed from {p.peer_id}: {exc}")
        return None

    feeds = [f for f in await asyncio.gather(*(ask(p) for p in providers)) if f is not None]
    missing = trusted - {p.peer_id for p in providers}
    notes += [f"{peer} (of the run's trainer and validators) is not among the run's providers"
              for peer in sorted(missing)]
    return feeds, notes


async def find_runs(swarm: Swarm, blobs: BlobService, *, heard: Sequence[RunListing] = (),
                    claims: dict[str, set[str]] | None = None) -> list[RunRow]:
    """Every run some provider of :data:`RUNS_KEY` (or a listing in ``heard``) names, whose manifest
    could be fetched and checked; newest first. A provider that answers wrong is recorded against it.
    ``claims``, when given, is filled with run ID -> every CID a listing names for it (fetched or not):
    listings that disagree about a run ID are a reason to refuse joining by that ID alone."""
    providers = (await swarm.find_providers(RUNS_KEY))[:MAX_PROVIDERS_ASKED]
    policy = AddressPolicy.from_swarm(swarm)

    async def ask(p: Provider) -> RunListing | None:
        try:
            return await _get_listing(policy, p)
        except MessageIgnored as exc:  # a stamp off our clock: a clock apart is no misbehaviour
            log.info("run listing of %s left out: %s", p.peer_id, exc)
        except ProtocolError as exc:
            swarm.peerbook.record_rejection(p.peer_id, f"run listing: {exc}")
        except TransportError as exc:
            log.info("no run listing from %s: %s", p.peer_id, exc)
        except (OSError, ValueError) as exc:  # anything else a provider's address can raise: skip it
            log.info("no run listing from %s: %r", p.peer_id, exc)
        return None

    listings = [x for x in await asyncio.gather(*(ask(p) for p in providers)) if x is not None]
    listings += heard
    if claims is not None:
        for listing in listings:
            for seen in listing.runs:
                claims.setdefault(seen.run_id, set()).add(seen.cid)
    cids = list(dict.fromkeys(seen.cid for listing in listings for seen in listing.runs))[:MAX_RUNS_LOOKED_AT]

    async def manifest(cid: str) -> RunManifest | None:
        try:
            run, _raw = await asyncio.wait_for(fetch_run(blobs, cid), MANIFEST_TIMEOUT_S)
            return run
        except (IntellectNodeError, asyncio.TimeoutError) as exc:
            log.info("listed run %s cannot be fetched: %r", cid, exc)
            return None

    manifests = dict(zip(cids, await asyncio.gather(*(manifest(c) for c in cids))))
    return rows_of(listings, manifests)


def _held_out_rank(h: HeldOutSeen | None, m: RunManifest) -> tuple[int, int]:
    """Which listed held-out result a row shows: the newest version, then one by a run validator."""
    if h is None:
        return (-1, -1)
    validators = (m.config_dict().get("run") or {}).get("validator_peer_ids") or []
    return (h.version, 1 if h.evaluator in validators else 0)


def rows_of(listings: Sequence[RunListing], manifests: dict[str, RunManifest | None]) -> list[RunRow]:
    """One row per listed run whose manifest is in ``manifests``, newest first."""
    rows: dict[str, RunRow] = {}
    reported: dict[str, list[dict[str, int]]] = {}
    for listing in listings:
        for seen in listing.runs:
            m = manifests.get(seen.cid)
            if m is None:
                continue
            row = rows.setdefault(seen.cid, RunRow(seen.cid, m))
            if listing.node not in row.listed_by:
                row.listed_by.append(listing.node)
            if seen.nodes:  # empty: the listing node does not count this run's nodes
                reported.setdefault(seen.cid, []).append(seen.nodes)
            row.policy_version = max(row.policy_version, seen.policy_version)
            row.step = max(row.step, seen.step)
            if _held_out_rank(seen.held_out, m) > _held_out_rank(row.held_out, m):
                row.held_out = seen.held_out
    # A role's count is the lower median over the listings that count the run's nodes (a role one does
    # not name: 0), not their maximum: one listing (a node's word) cannot inflate a run's counts; a
    # majority of the listings still can.
    for cid, reports in reported.items():
        for role in sorted({r for nodes in reports for r in nodes}):
            counts = sorted(nodes.get(role, 0) for nodes in reports)
            if n := counts[(len(counts) - 1) // 2]:
                rows[cid].nodes[role] = n
    return sorted(rows.values(), key=lambda r: -r.manifest.created_ms)


MAX_HEARD_LISTINGS = RunsService.MAX_HEARD
"""Listings ``runs --wait`` keeps: the newest per node, this many nodes at most (the earliest heard go)."""


async def listen_for_listings(swarm: Swarm) -> list[RunListing]:
    """Subscribe to the runs topic; the returned list fills with the listings heard from then on, the
    newest per node and :data:`MAX_HEARD_LISTINGS` at most."""
    heard: list[RunListing] = []
    by_node: dict[str, RunListing] = {}

    def validate(data: bytes, origin: str) -> RunListing:
        return open_listing(data, now_ms=int(time.time() * 1000), signer=origin)

    def keep(listing: RunListing, origin: str) -> None:
        by_node.pop(origin, None)
        by_node[origin] = listing
        while len(by_node) > MAX_HEARD_LISTINGS:
            by_node.pop(next(iter(by_node)))
        heard[:] = by_node.values()

    swarm.subscribe(RUNS_TOPIC, validate, keep)
    return heard


def keep_run(data_dir: Path, cid: str, raw: bytes) -> Path:
    """Write the run's signed manifest to ``<data-dir>/runs/<cid>.run`` (atomically): the node lists it."""
    path = run_file(data_dir, cid)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, raw)
    return path
