"""The ``[nat]`` section of the node config: reachability checks, relaying, hole punching.

The NAT code is ``p2p/nat/``; this section lives with the others in the configuration package, hung
off :class:`intellect_node.config.NodeConfig`. No libp2p import here: config is parsed before the heavy
stack loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class NatConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    enabled: bool = True
    """Run AutoNAT, relay and hole punching. Off: the node is reachable only at its listen addresses."""

    check_interval: float = Field(default=300.0, ge=1.0, le=86400.0)
    """Seconds between reachability checks once a verdict is known (every 2 s until then)."""

    autonat_servers: int = Field(default=4, ge=1, le=16)
    """Connected peers asked to dial this node back at each check."""

    autonat_confirmations: int = Field(default=2, ge=1, le=16)
    """Agreeing answers needed for PUBLIC or PRIVATE (libp2p's spec suggests 4 in large networks; small
    swarms rarely have that many peers to ask)."""

    relay_service: Literal["auto", "on", "off"] = "auto"
    """Serve as a circuit relay v2: ``auto`` once AutoNAT says PUBLIC, ``on`` always, ``off`` never."""

    relay_max_reservations: int = Field(default=128, ge=1, le=100_000)
    """Relay: peers that may hold a reservation at once."""

    relay_max_circuits: int = Field(default=16, ge=1, le=1024)
    """Relay: concurrent circuits to one reserving peer."""

    relay_max_circuits_total: int = Field(default=256, ge=1, le=100_000)
    """Relay: concurrent circuits in all."""

    relay_max_bytes: int = Field(default=1 << 30, ge=1024)
    """Relay: bytes one circuit may carry (both directions); the relay resets it beyond that."""

    relay_max_duration: int = Field(default=3600, ge=1)
    """Relay: seconds one circuit may last."""

    relay_reservation_ttl: int = Field(default=3600, ge=5)
    """Relay: seconds a reservation lasts; clients renew at half of it."""

    relays_wanted: int = Field(default=2, ge=1, le=8)
    """Private node: relays to hold reservations with (more than one, so one dying is no outage)."""

    relay_check_interval: float = Field(default=5.0, ge=0.2, le=600.0)
    """Private node: seconds between checks of its reservations (dead relay, renewal due, top-up)."""

    static_relays: list[str] = Field(default_factory=list)
    """Private node: relays to try before those found in the DHT (multiaddrs ending /p2p/<id>)."""

    hole_punching: bool = True
    """Try DCUtR to turn relayed connections into direct ones."""

    @field_validator("static_relays")
    @classmethod
    def _relays(cls, value: list[str]) -> list[str]:
        import multiaddr  # deferred: part of the libp2p stack

        for text in value:
            try:
                ma = multiaddr.Multiaddr(text)
            except Exception as exc:  # multiaddr raises several unrelated types for bad input
                raise ValueError(f"{text!r} is not a multiaddr ({exc})") from exc
            if "p2p" not in [p.name for p in ma.protocols()]:
                raise ValueError(f"{text!r} must end with /p2p/<relay peer id>")
        return value
