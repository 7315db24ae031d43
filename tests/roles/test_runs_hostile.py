"""Hostile input to the runs lookup (``roles/runs.py``): one provider whose address cannot be
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
    return asyncio.run(find_runs(swarm, None, heard=heard or []))  # type: ignore[arg-type]  # a stand-in for it


def test_a_provider_whose_host_does_not_resolve_is_skipped() -> None:
    hostile = Provider("12D3KooWhostile", "http://no-such-host.invalid:8080")
    assert _find(_Swarm([hostile])) == []


class _Store:
    def manifest(self, _cid: str) -> None:
        return None

    def missing(self, _cid: str) -> bool:
        return True


class _Blobs:
    """Serves nothing: every listed manifest's fetch fails as an unserved blob does."""

    store = _Store()

    async def fetch(self, cid: str, **_kw: object) -> None:
        from intellect_node.errors import TransportError

        raise TransportError(f"no provider serves {cid}")


def test_every_cid_listed_for_a_run_id_is_reported_fetched_or_not() -> None:
    from intellect_node.protocol.ids import cid_of
    from intellect_node.protocol.run_manifest import RunSeen

    a, b = cid_of(b"a"), cid_of(b"b")
    heard = [RunListing(node="12D3KooWone", time_ms=1, runs=[RunSeen(cid=a, run_id="r1", nodes={})]),
             RunListing(node="12D3KooWtwo", time_ms=1, runs=[RunSeen(cid=b, run_id="r1", nodes={})])]
    claims: dict[str, set[str]] = {}
    rows = asyncio.run(find_runs(_Swarm([]), _Blobs(), heard=heard, claims=claims))  # type: ignore[arg-type]  # a stand-in for it
    assert rows == [] and claims == {"r1": {a, b}}


def _run() -> Any:
    from intellect_node.protocol.ids import cid_of
    from intellect_node.protocol.run_manifest import ModelFile, RunManifest

    return RunManifest(format="intellect-node/run/1", run_id="r1", organiser="12D3KooWorg", created_ms=1,
                       model_name="m", model_files=[ModelFile(path="config.json", blob=cid_of(b"c"), size=1)],
                       config="{}", thresholds="{}")


def test_one_listing_cannot_inflate_a_runs_counts() -> None:
    from intellect_node.protocol.ids import cid_of
    from intellect_node.protocol.run_manifest import RunSeen
    from intellect_node.roles.runs import rows_of

    cid = cid_of(b"run")
    honest = [RunListing(node=f"12D3KooWh{i}", time_ms=1,
                         runs=[RunSeen(cid=cid, run_id="r1", nodes={"worker": 3, "trainer": 1})])
              for i in range(2)]
    hostile = RunListing(node="12D3KooWbad", time_ms=1,
                         runs=[RunSeen(cid=cid, run_id="r1", nodes={"worker": 10_000, "validator": 500})])
    silent = RunListing(node="12D3KooWother", time_ms=1, runs=[RunSeen(cid=cid, run_id="r1", nodes={})])
    (row,) = rows_of([*honest, hostile, silent], {cid: _run()})
    assert row.nodes == {"worker": 3, "trainer": 1}
    assert len(row.listed_by) == 4


def test_listings_heard_while_waiting_are_bounded_newest_per_node() -> None:
    from intellect_node.roles.runs import MAX_HEARD_LISTINGS, listen_for_listings

    handlers: list[Any] = []

    class _Sub:
        def subscribe(self, _topic: str, _validate: Any, on_message: Any) -> None:
            handlers.append(on_message)

    heard = asyncio.run(listen_for_listings(_Sub()))  # type: ignore[arg-type]  # a stand-in for it
    (on_message,) = handlers
    for i in range(3 * MAX_HEARD_LISTINGS):
        node = f"12D3KooW{i}"
        on_message(RunListing(node=node, time_ms=i, runs=[]), node)
    for t in (1, 2):
        on_message(RunListing(node="12D3KooWlast", time_ms=t, runs=[]), "12D3KooWlast")
    assert len(heard) == MAX_HEARD_LISTINGS
    assert [x.time_ms for x in heard if x.node == "12D3KooWlast"] == [2]


def test_a_row_shows_the_newest_held_out_result_a_run_validator_before_another_node() -> None:
    import json

    import msgspec

    from intellect_node.commands.runs import render
    from intellect_node.protocol.ids import cid_of
    from intellect_node.protocol.run_manifest import HeldOutSeen, RunSeen
    from intellect_node.roles.runs import rows_of

    cid = cid_of(b"run")
    validator, other = "12D3KooWvalidator", "12D3KooWother"
    run = msgspec.structs.replace(_run(), config=json.dumps({"run": {"validator_peer_ids": [validator]}}))

    def listed(node: str, version: int, by: str, rate: float) -> RunListing:
        held = HeldOutSeen(version=version, n=128, pass_rate=rate, mean_reward=rate, evaluator=by)
        return RunListing(node=node, time_ms=1, runs=[RunSeen(cid=cid, run_id="r1", nodes={}, held_out=held)])

    (row,) = rows_of([listed("12D3KooWa", 5, validator, 0.2), listed("12D3KooWb", 10, other, 0.9),
                      listed("12D3KooWc", 10, validator, 0.3), listed("12D3KooWd", 5, other, 0.99)],
                     {cid: run})
    assert row.held_out is not None and (row.held_out.version, row.held_out.evaluator) == (10, validator)
    out = render([row.to_json(now_ms=1)])
    assert "HELD-OUT" in out and "0.30 v10 n=128 by " + validator[-8:] in out
    bare = RunListing(node="12D3KooWa", time_ms=1, runs=[RunSeen(cid=cid, run_id="r1", nodes={})])
    (none,) = rows_of([bare], {cid: run})
    assert none.held_out is None and none.to_json(now_ms=1)["held_out"] is None
