"""Hostile input to the runs lookup (``roles/runs.py``, issue 40): one provider whose address cannot be
resolved, or listings that disagree about a run ID, must not crash or steer ``runs`` / ``join --run``.
The lookup through a real swarm: tests/system/test_run_by_cid.py."""

from __future__ import annotations

import asyncio
from typing import Any

from intellect_node.p2p.swarm import Provider
from intellect_node.protocol.run_manifest import RunListing
from intellect_node.roles.runs import find_runs


class _Peerbook:
    def __init__(self) -> None:
        self.rejections: list[tuple[str, str]] = []

    def record_rejection(self, peer_id: str, reason: str) -> None:
        self.rejections.append((peer_id, reason))

    def addresses(self, _peer_id: str) -> tuple[list[str], list[str]]:
        return [], []


class _Swarm:
    """What ``find_runs`` uses of a swarm: the providers of the runs key, the peerbook, own addresses."""

    http_url = "http://127.0.0.1:1"

    def __init__(self, providers: list[Provider]) -> None:
        self.providers = providers
        self.peerbook = _Peerbook()

    async def find_providers(self, _key: str) -> list[Provider]:
        return self.providers

    def listen_addrs(self) -> list[str]:
        return ["/ip4/127.0.0.1/tcp/1"]


def _find(swarm: _Swarm, heard: list[RunListing] | None = None) -> Any:
    return asyncio.run(find_runs(swarm, None, heard=heard or []))  # type: ignore[arg-type]


def test_a_provider_whose_host_does_not_resolve_is_skipped() -> None:
    hostile = Provider("12D3KooWhostile", "http://no-such-host.invalid:8080")
    assert _find(_Swarm([hostile])) == []
