"""The node's configuration tree (pydantic, ``extra="forbid"``, a docstring on every field).

Sections: ``network`` (libp2p, HTTP, heartbeats) and ``run`` (what the swarm trains and whom it trusts).
Further sections (roles, proofs, TOML files, environment overrides) hang off :class:`NodeConfig` the
same way. :func:`build_config` turns pydantic's errors into one :class:`ConfigError` that names the
field (``network.bootstrap[0]``) and what is wrong with it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.protocol.ids import public_key_from_peer_id
from intellect_node.protocol.topics import validate_run_id


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


def _check_multiaddr(text: str, *, needs_peer: bool) -> str:
    import multiaddr  # deferred: part of the libp2p stack, not needed to print --help

    try:
        ma = multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises several unrelated types for bad input
        raise ValueError(f"{text!r} is not a multiaddr ({exc}); e.g. /ip4/127.0.0.1/tcp/4001") from exc
    protos = [p.name for p in ma.protocols()]
    if needs_peer and "p2p" not in protos:
        raise ValueError(f"{text!r} must end with /p2p/<peer id>")
    if not needs_peer and "tcp" not in protos:
        raise ValueError(f"{text!r} must be a TCP address, e.g. /ip4/0.0.0.0/tcp/4001")
    return text


class NetworkConfig(_Section):
    listen: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"], min_length=1)
    """libp2p listen multiaddrs (TCP). Port 0 picks a free port; use e.g. /ip4/0.0.0.0/tcp/4001 to be
    reachable from other machines."""

    bootstrap: list[str] = Field(default_factory=list)
    """Peers dialled at start (multiaddrs ending /p2p/<peer id>). If none answers, peers remembered in
    <data-dir>/peers.json are tried."""

    http_host: str | None = None
    """Address the bulk HTTP server binds. Default: the IP of the first listen address."""

    http_port: int = Field(default=0, ge=0, le=65535)
    """Port of the bulk HTTP server (chunks, manifests); 0 picks a free port."""

    http_public_url: str | None = None
    """HTTP base URL advertised to peers (e.g. behind a port forward). Default: http://<host>:<port>."""

    control_port: int = Field(default=0, ge=0, le=65535)
    """Port of the local control API (always bound to 127.0.0.1); 0 picks a free port."""

    heartbeat_interval: float = Field(default=5.0, gt=0, le=300)
    """Seconds between this node's heartbeats on the run's heartbeat topic."""

    peer_timeout: float = Field(default=20.0, gt=0, le=3600)
    """Seconds without a heartbeat after which a peer is marked gone (more than heartbeat_interval)."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: list[str]) -> list[str]:
        return [_check_multiaddr(a, needs_peer=False) for a in v]

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, v: list[str]) -> list[str]:
        return [_check_multiaddr(a, needs_peer=True) for a in v]

    @field_validator("http_public_url")
    @classmethod
    def _public_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} must start with http:// or https://")
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _timeouts(self) -> "NetworkConfig":
        if self.peer_timeout <= self.heartbeat_interval:
            raise ValueError(f"peer_timeout ({self.peer_timeout}) must exceed heartbeat_interval "
                             f"({self.heartbeat_interval}); about 3-4 intervals is usual")
        return self


class RunConfig(_Section):
    run_id: str = "default"
    """The run this node takes part in: gossip topics are /intellect/<run_id>/<kind>/1 and messages of
    other runs are dropped. 1-64 chars of a-z 0-9 . _ -."""

    trainer_peer_id: str | None = None
    """Peer ID (12D3KooW...) of the run's trainer: the only peer whose policy announcements are trusted."""

    model: str = ""
    """Model the run trains (a name or a local path), the same on every node of the run."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for inference and proofs; float32 on CPU-only machines."""

    async_level: int = Field(default=2, ge=0, le=16)
    """How many policy steps a rollout may lag the trainer (prime-rl's ``async_level``, default 2; 0 is
    synchronous RL)."""

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        try:
            return validate_run_id(v)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("trainer_peer_id")
    @classmethod
    def _trainer(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                public_key_from_peer_id(v)
            except ProtocolError as exc:
                raise ValueError(f"{v!r} is not an ed25519 peer ID (12D3KooW...)") from exc
        return v


class NodeConfig(_Section):
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """libp2p, HTTP and liveness settings."""

    run: RunConfig = Field(default_factory=RunConfig)
    """The run: its ID, trainer, model and asynchrony."""


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def build_config(data: dict[str, Any] | None = None, **sections: Any) -> NodeConfig:
    """Validate a config dict (``{"network": {...}, "run": {...}}``); ConfigError names the field."""
    merged: dict[str, Any] = dict(data or {})
    merged.update(sections)
    try:
        return NodeConfig.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = _loc(err["loc"]) or "config"
        msg = str(err["msg"]).removeprefix("Value error, ")
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise ConfigError(f"config field {field}: {msg}{more}", field=field) from exc
