"""Gossip topics and libp2p protocol IDs of the swarm layer.

Topics are ``/intellect/<run_id>/<kind>/1``; every message also carries its ``run_id`` so a validator
can drop other runs' messages even if a peer publishes them on the wrong topic. Run IDs are short,
lowercase and path-safe so they can appear in a topic string and a file name.
"""

from __future__ import annotations

import re

from intellect_node.errors import ProtocolError

KINDS = ("heartbeat", "policy", "rollouts", "verdicts", "sweep", "steps", "audits", "conflicts", "evals")
"""Topic kinds of a run (see docs/architecture.md). Owners of the other parts define their messages."""

INFO_PROTOCOL_ID = "/intellect/info/1.0.0"
"""Request/response over a libp2p stream: the dialer sends nothing, the listener answers one signed
``NodeInfo`` envelope (its HTTP base URL, addresses, run) and closes."""

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is 1-64 chars of ``[a-z0-9._-]`` starting alphanumeric; else ProtocolError."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise ProtocolError(f"bad run id {str(run_id)[:80]!r}: use 1-64 chars of a-z 0-9 . _ - "
                            "starting with a letter or digit")
    return run_id


def topic(run_id: str, kind: str) -> str:
    """The gossip topic for ``kind`` in run ``run_id``."""
    if kind not in KINDS:
        raise ValueError(f"unknown topic kind {kind!r}; one of {', '.join(KINDS)}")
    return f"/intellect/{validate_run_id(run_id)}/{kind}/1"


def parse_topic(name: str) -> tuple[str, str]:
    """``(run_id, kind)`` of a topic string; ProtocolError if it is not one of ours."""
    parts = name.split("/") if isinstance(name, str) else []
    if len(parts) != 5 or parts[0] != "" or parts[1] != "intellect" or parts[4] != "1" \
            or parts[3] not in KINDS:
        raise ProtocolError(f"not an intellect topic: {str(name)[:120]!r}")
    return validate_run_id(parts[2]), parts[3]
