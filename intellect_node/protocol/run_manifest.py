"""The run manifest: a run as one signed, content-addressed object, and the run listings nodes serve.

A run organiser (``intellect-node run init``) signs one :class:`RunManifest`: the run-wide configuration
(the ``[run]`` and ``[rl]`` sections every node of the run must share), the proof thresholds file, the
starting model's files (each a blob CID), and the organiser's bootstrap addresses. The signed envelope
bytes are stored as a blob; that blob's CID is the run's identity (``join --run CID``). The blob CID names
a blob manifest that lists the envelope's chunk CIDs, so changing any field gives another CID, and the
blob's publisher must be the organiser who signed the run manifest (:func:`check_run_blob`).

What a participant trusts is the CID (and, with ``join --organiser PEER``, the organiser's peer ID):
:func:`open_run_manifest` decodes strictly (size bounded before decoding, unknown fields refused, the
canonical bytes only), checks the signature and every bound below. Whether the configuration is a valid
node configuration is checked one layer up (``config.run_manifest``), where the schema lives.

Run listings. A node that holds run manifests provides :data:`RUNS_KEY` in the DHT (a well-known CID:
"I list runs"), answers ``GET /runs/v1`` on its bulk HTTP server with a :class:`RunListing` signed by
its own key (which runs it holds, and what it sees of each: nodes per role, the newest policy version
and step), and publishes the same listing on the gossip topic :data:`RUNS_TOPIC`. A listing is what one
node says it sees, nothing more: only the manifest behind a CID is the organiser's word.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.blob import Manifest
from intellect_node.protocol.freshness import check_stamp
from intellect_node.protocol.ids import cid_of, public_key_from_peer_id, validate_cid
from intellect_node.protocol.signing import SigningKey, open_envelope
from intellect_node.protocol.topics import validate_run_id

RUN_DOMAIN = "intellect/run-manifest/1"
"""Signature domain of run manifests."""
LISTING_DOMAIN = "intellect/run-listing/1"
"""Signature domain of run listings (a node's view of the runs it holds)."""
RUN_FORMAT = "intellect-node/run/1"

RUNS_KEY = cid_of(b"intellect-node/runs/1")
"""The DHT key under which nodes that list runs put provider records (a CID of a fixed string: the DHT
keys provider records by CID)."""
RUNS_TOPIC = "/intellect/runs/1"
"""Gossip topic of run listings (not a run's topic: it is shared by every run)."""
RUNS_HTTP_PATH = "/runs/v1"
"""``GET`` on a node's bulk HTTP base URL: its signed :class:`RunListing`."""

MAX_CONFIG_BYTES = 64 * 1024
"""The run's ``[run]`` and ``[rl]`` sections as canonical JSON: a few KiB in practice."""
MAX_THRESHOLDS_BYTES = 256 * 1024
"""A thresholds file holds one small entry per engine pair: a few KiB."""
MAX_MODEL_FILES = 64
"""A Hugging Face model folder: config, tokenizer files, up to a few dozen weight shards."""
MAX_PATH_LEN = 128
MAX_NAME_LEN = 128
MAX_BOOTSTRAP = 16
MAX_ADDR_LEN = 256
MAX_FILE_SIZE = 1 << 44
"""16 TiB: no model file reaches it; bounds hostile integers."""
MAX_RUN_MANIFEST_BYTES = MAX_CONFIG_BYTES + MAX_THRESHOLDS_BYTES + MAX_MODEL_FILES * 512 + \
    MAX_BOOTSTRAP * (MAX_ADDR_LEN + 4) + 4096
"""Upper bound of an encoded manifest payload (about 360 KiB), checked before decoding."""
MAX_RUN_ENVELOPE_BYTES = MAX_RUN_MANIFEST_BYTES + 512

MAX_LISTED_RUNS = 32
"""Runs one listing names; a node holding more lists the newest."""
MAX_LISTING_BYTES = MAX_LISTED_RUNS * 512 + 1024
MAX_ROLE_NAME = 32
MAX_LISTING_AGE_MS = 10 * 60 * 1000
"""Listings stamped further than this from the reader's clock are ignored (``MessageIgnored``: replays,
broken clocks), blamed on no one."""


class ModelFile(codec.Message, frozen=True):
    """One file of the starting model's folder: its path in the folder and the blob holding it."""

    path: str
    blob: str  # blob CID; its publisher is the run's organiser
    size: int


class RunManifest(codec.Message, frozen=True):
    """What a run is. ``config`` holds the canonical JSON of ``{"run": {...}, "rl": {...}}`` (the
    settings every node of the run shares); ``thresholds`` the proof thresholds file's text."""

    format: Literal["intellect-node/run/1"]
    run_id: str
    organiser: str  # peer ID of the signer
    created_ms: int
    model_name: str
    model_files: list[ModelFile]
    config: str
    thresholds: str
    bootstrap: list[str] = []

    def config_dict(self) -> dict[str, Any]:
        """The run-wide sections (``run``, ``rl``) as a dict."""
        doc: dict[str, Any] = json.loads(self.config)
        return doc

    @property
    def thresholds_sha256(self) -> str:
        return hashlib.sha256(self.thresholds.encode("utf-8")).hexdigest()

    @property
    def env(self) -> str:
        """The run's reward environment or task, for listings."""
        rl = self.config_dict().get("rl", {})
        return str(rl.get("env") or rl.get("tasks_file") or rl.get("task") or "add3")

    @property
    def model_bytes(self) -> int:
        return sum(f.size for f in self.model_files)


def canonical_json(doc: object) -> str:
    """The one JSON text of ``doc`` a manifest carries: sorted keys, no spaces, ASCII."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _check_text(what: str, text: str, limit: int) -> None:
    if not text or len(text) > limit or any(ord(c) < 32 for c in text):
        raise ProtocolError(f"{what} must be 1..{limit} printable characters")


def check_run_manifest(m: RunManifest) -> RunManifest:
    """Raise ProtocolError unless ``m`` is within every bound and internally consistent."""
    validate_run_id(m.run_id)
    public_key_from_peer_id(m.organiser)
    if not 0 < m.created_ms < 1 << 53:
        raise ProtocolError(f"created_ms {m.created_ms} out of range")
    _check_text("model_name", m.model_name, MAX_NAME_LEN)
    if not 0 < len(m.model_files) <= MAX_MODEL_FILES:
        raise ProtocolError(f"a run lists 1..{MAX_MODEL_FILES} model files, not {len(m.model_files)}")
    paths: set[str] = set()
    for f in m.model_files:
        _check_text("model file path", f.path, MAX_PATH_LEN)
        if "/" in f.path or "\\" in f.path or f.path in (".", "..") or f.path.startswith("."):
            raise ProtocolError(f"model file path {f.path[:MAX_PATH_LEN]!r} is not a plain file name")
        if f.path in paths:
            raise ProtocolError(f"model file {f.path!r} listed twice")
        paths.add(f.path)
        validate_cid(f.blob)
        if not 0 <= f.size < MAX_FILE_SIZE:
            raise ProtocolError(f"model file size {f.size} out of range")
    if "config.json" not in paths:
        raise ProtocolError("the model files lack config.json")
    if len(m.config) > MAX_CONFIG_BYTES or len(m.thresholds) > MAX_THRESHOLDS_BYTES:
        raise ProtocolError("config or thresholds exceed their size limit")
    try:
        doc = json.loads(m.config)
    except ValueError as exc:
        raise ProtocolError(f"config is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not set(doc) <= {"run", "rl"} or \
            not all(isinstance(v, dict) for v in doc.values()):
        raise ProtocolError("config must be a JSON object with only the sections run and rl")
    if canonical_json(doc) != m.config:
        raise ProtocolError("config is not canonical JSON")
    if doc.get("run", {}).get("run_id", m.run_id) != m.run_id:
        raise ProtocolError("config's run.run_id differs from the manifest's run_id")
    try:
        thresholds = json.loads(m.thresholds)
    except ValueError as exc:
        raise ProtocolError(f"thresholds are not JSON: {exc}") from exc
    if not isinstance(thresholds, dict):
        raise ProtocolError("thresholds must be a JSON object")
    if len(m.bootstrap) > MAX_BOOTSTRAP:
        raise ProtocolError(f"{len(m.bootstrap)} bootstrap addresses, at most {MAX_BOOTSTRAP}")
    for addr in m.bootstrap:
        _check_text("bootstrap address", addr, MAX_ADDR_LEN)
        if not addr.startswith("/") or "/p2p/" not in addr:
            raise ProtocolError(f"bootstrap address {addr[:MAX_ADDR_LEN]!r} is not a multiaddr ending "
                                "/p2p/<peer id>")
    return m


def seal_run_manifest(key: SigningKey, m: RunManifest) -> bytes:
    """The organiser's signed envelope bytes (the content of the run's blob)."""
    if m.organiser != key.peer_id:
        raise ValueError("the manifest's organiser must be the signing key's peer ID")
    check_run_manifest(m)
    raw = key.seal(RUN_DOMAIN, m)
    if len(raw) > MAX_RUN_ENVELOPE_BYTES:
        raise ValueError(f"the run manifest takes {len(raw)} bytes, more than {MAX_RUN_ENVELOPE_BYTES}")
    return raw


def open_run_manifest(raw: bytes | bytearray, *, organiser: str | None = None) -> RunManifest:
    """Strictly decode and verify run manifest envelope bytes; ProtocolError for anything wrong.
    ``organiser``: the peer ID that must have signed it (``join --organiser``)."""
    if len(raw) > MAX_RUN_ENVELOPE_BYTES:
        raise ProtocolError(f"run manifest of {len(raw)} bytes exceeds {MAX_RUN_ENVELOPE_BYTES}")
    m, signer = open_envelope(bytes(raw), RUN_DOMAIN, RunManifest, max_size=MAX_RUN_MANIFEST_BYTES)
    if m.organiser != signer:
        raise ProtocolError("the run manifest's organiser is not its signer")
    if organiser is not None and signer != organiser:
        raise ProtocolError(f"the run manifest is signed by {signer}, not by the organiser {organiser}")
    return check_run_manifest(m)


def check_run_blob(blob: Manifest, run: RunManifest) -> None:
    """The blob that carries a run manifest must be published by the run's organiser: the run's CID
    then pins the organiser's key as well as every byte."""
    if blob.publisher != run.organiser:
        raise ProtocolError(f"the run's blob is published by {blob.publisher}, not by its organiser "
                            f"{run.organiser}")


def check_model_blob(blob: Manifest, run: RunManifest, file: ModelFile) -> None:
    """A model file's blob: published by the organiser, of the size the manifest lists."""
    if blob.publisher != run.organiser:
        raise ProtocolError(f"model file {file.path} is published by {blob.publisher}, not by the run's "
                            f"organiser {run.organiser}")
    if blob.total_size != file.size:
        raise ProtocolError(f"model file {file.path} holds {blob.total_size} bytes, the run lists "
                            f"{file.size}")


# -- listings --------------------------------------------------------------------------------------


class HeldOutSeen(codec.Message, frozen=True):
    """The newest held-out evaluation the listing node took for its run (``roles/validator/evals.py``):
    the listing node's word of a result ``evaluator`` signed, which a validator of the run checks."""

    version: int
    n: int
    pass_rate: float
    mean_reward: float
    evaluator: str  # peer ID of the node whose signed result this is


class RunSeen(codec.Message, frozen=True):
    """One run as the listing node sees it. ``policy_version`` and ``step`` are -1 when it does not
    know them (it follows no policy, it is not the trainer); ``held_out`` is None when it holds no
    held-out result of the run (only validators of a run with ``run.eval_every`` take them)."""

    cid: str  # the run's blob CID
    run_id: str
    nodes: dict[str, int]  # role -> alive nodes of that role seen (the listing node included)
    policy_version: int = -1
    step: int = -1
    held_out: HeldOutSeen | None = None


class RunListing(codec.Message, frozen=True):
    node: str  # peer ID of the signer
    time_ms: int
    runs: list[RunSeen]


def check_listing(listing: RunListing) -> RunListing:
    public_key_from_peer_id(listing.node)
    if len(listing.runs) > MAX_LISTED_RUNS:
        raise ProtocolError(f"{len(listing.runs)} runs listed, at most {MAX_LISTED_RUNS}")
    for r in listing.runs:
        validate_cid(r.cid)
        validate_run_id(r.run_id)
        if len(r.nodes) > 8 or any(not 0 < len(k) <= MAX_ROLE_NAME or not 0 <= v < 1 << 31
                                   for k, v in r.nodes.items()):
            raise ProtocolError("a listing's node counts are out of bounds")
        if not -1 <= r.policy_version < 1 << 62 or not -1 <= r.step < 1 << 62:
            raise ProtocolError("a listing's policy version or step is out of range")
        if (h := r.held_out) is not None:
            if not (0 <= h.version < 1 << 62 and 1 <= h.n <= 1 << 16 and 0.0 <= h.pass_rate <= 1.0
                    and math.isfinite(h.mean_reward) and abs(h.mean_reward) <= 1e6):
                raise ProtocolError("a listing's held-out figures are out of range")
            public_key_from_peer_id(h.evaluator)
    return listing


def seal_listing(key: SigningKey, listing: RunListing) -> bytes:
    if listing.node != key.peer_id:
        raise ValueError("a listing is signed by the node it names")
    return key.seal(LISTING_DOMAIN, check_listing(listing))


def open_listing(raw: bytes, *, now_ms: int, signer: str | None = None) -> RunListing:
    """Decode and verify a listing; ``signer``: the peer it must come from (the gossip origin, the
    provider asked). ProtocolError for anything wrong; ``MessageIgnored`` for a stale or future stamp."""
    listing, by = open_envelope(raw, LISTING_DOMAIN, RunListing, max_size=MAX_LISTING_BYTES)
    if listing.node != by or (signer is not None and by != signer):
        raise ProtocolError("the listing is not signed by the node it names")
    check_listing(listing)
    check_stamp(listing.time_ms, now_ms, max_age_ms=MAX_LISTING_AGE_MS, max_ahead_ms=MAX_LISTING_AGE_MS,
                what="run listing")
    return listing
