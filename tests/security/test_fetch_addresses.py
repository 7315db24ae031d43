"""A worker must not choose where a validator sends requests.

A provider's URL may only lead back to that provider (``blobs/addresses.py``): an address its connection
came from or a public address it announced; loopback and private addresses only where the peer connects
from and only when this node itself runs there. Everything here runs on 127.0.0.1, as every test does:
the rule must let such nodes fetch from each other and still refuse a peer that points elsewhere. And no
provider's error text reaches what a node publishes (``public_reason``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from intellect_node.blobs.addresses import AddressPolicy, AddressRefused, PeerAddresses, kind, source_address
from intellect_node.blobs.fetch import StaticProvider, public_reason
from intellect_node.blobs.http import HttpChunkSource, blob_routes
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import TransportError
from intellect_node.p2p.peerbook import PeerBook
from intellect_node.protocol.signing import SigningKey


def _policy(own: list[str], book: PeerBook) -> AddressPolicy:
    def peer(p: str) -> PeerAddresses:
        connected, announced = book.addresses(p)
        return PeerAddresses(frozenset(connected), frozenset(announced))

    return AddressPolicy(lambda: own, peer)


def test_kinds() -> None:
    assert kind("127.0.0.1") == kind("::1") == kind("::ffff:127.0.0.1") == "loopback"
    assert kind("10.1.2.3") == kind("192.168.0.1") == kind("fd00::1") == kind("100.64.0.1") == "private"
    assert kind("169.254.169.254") == kind("fe80::1") == "link-local"
    assert kind("8.8.8.8") == kind("2001:4860::8888") == "global"
    assert kind("0.0.0.0") == kind("224.0.0.1") == kind("240.0.0.1") == kind("x") == "forbidden"


def test_the_rule() -> None:
    book = PeerBook("me")
    book.set_connected("lan", True, remote_ip="10.0.0.5")
    book.set_connected("local", True, remote_ip="127.0.0.1")
    book.set_connected("far", True, remote_ip="9.9.9.9")
    book.heard("far", http_url="http://198.51.100.1:1", addrs=["/ip4/8.8.8.8/tcp/4001/p2p/far",
                                                                 "/ip4/10.0.0.7/tcp/4001/p2p/far",
                                                                 "/ip4/127.0.0.1/tcp/4001/p2p/far"])
    on_loopback = _policy(["http://127.0.0.1:8000", "/ip4/127.0.0.1/tcp/4001"], book)
    on_lan = _policy(["http://10.0.0.2:8000", "/ip4/0.0.0.0/tcp/4001"], book)
    public = _policy(["http://8.8.4.4:8000"], book)

    assert on_loopback.refusal("local", "127.0.0.1") == ""  # nodes on one machine: every test
    assert public.refusal("local", "127.0.0.1")  # this node does not run on loopback
    assert on_lan.refusal("lan", "10.0.0.5") == "" and public.refusal("lan", "10.0.0.5")
    # A peer on the internet cannot point into this machine or its LAN, whatever it announces.
    assert on_loopback.refusal("far", "127.0.0.1") and on_lan.refusal("far", "10.0.0.7")
    assert on_lan.refusal("lan", "10.0.0.6")  # another LAN host than the peer
    # Public addresses: where it connects from, or one it announced once proven (below); no one else's.
    assert public.refusal("far", "9.9.9.9") == ""
    assert "not proven" in public.refusal("far", "8.8.8.8") and public.needs_proof("far", "8.8.8.8")
    assert public.refusal("far", "1.1.1.1") and not public.needs_proof("far", "1.1.1.1")
    assert public.refusal("unknown", "8.8.8.8")
    assert on_loopback.refusal("far", "169.254.169.254") and on_loopback.refusal("local", "0.0.0.0")
    # A node behind NAT that listens on 0.0.0.0 and is reached through a relay advertises no concrete
    # address: its route says where it runs (a private address the peer is connected from, if this
    # machine's route to it leaves from a private address), never loopback.
    relayed = _policy(["p2p://me", "/ip4/0.0.0.0/tcp/4001"], book)
    assert relayed.refusal("local", "127.0.0.1")
    route = kind(source_address("10.0.0.5"))
    assert (relayed.refusal("lan", "10.0.0.5") == "") == (route == "private")
    assert relayed.refusal("far", "10.0.0.7")  # not where that peer connects from


def test_an_announced_public_address_is_used_only_once_the_peer_answered_there() -> None:
    """A signed listen address proves only that the peer typed it. Before, any key could
    announce a third party's public host (its heartbeat's addresses) and have every node that fetched
    from it send requests there; now the address is dialled first (libp2p: the Noise handshake answers
    with the peer's key only if the peer is there), and a failed proof is not retried for a while."""
    book = PeerBook("me")
    book.set_connected("far", True, remote_ip="9.9.9.9")
    book.heard("far", addrs=["/ip4/8.8.8.8/tcp/4001/p2p/far", "/ip4/203.0.113.9/tcp/4001/p2p/far"])
    dialled: list[tuple[str, str]] = []

    async def dial(peer_id: str, ip: str) -> bool:
        dialled.append((peer_id, ip))
        if ip != "8.8.8.8":
            return False  # a third party's host: no libp2p with the peer's key answers there
        book.set_connected(peer_id, True, remote_ip=ip)
        return True

    def peer(p: str) -> PeerAddresses:
        connected, announced = book.addresses(p)
        return PeerAddresses(frozenset(connected), frozenset(announced))

    policy = AddressPolicy(lambda: ["http://8.8.4.4:8000"], peer, dial)

    async def main() -> None:
        assert policy.refusal("far", "8.8.8.8")
        assert await policy.prove("far", "8.8.8.8")
        assert policy.refusal("far", "8.8.8.8") == "" and not policy.needs_proof("far", "8.8.8.8")
        assert policy.needs_proof("far", "203.0.113.9") is False  # documentation range: never fetched
        book.heard("far", addrs=["/ip4/1.1.1.1/tcp/4001/p2p/far"])
        assert not await policy.prove("far", "1.1.1.1")
        assert not await policy.prove("far", "1.1.1.1")  # not dialled again within PROOF_RETRY_S
        assert "not proven" in policy.refusal("far", "1.1.1.1")

    asyncio.run(main())
    assert dialled == [("far", "8.8.8.8"), ("far", "1.1.1.1")]
    assert policy.proofs == {"proven": 1, "failed": 1}


def test_a_worker_url_pointing_elsewhere_sends_no_request(tmp_path: Path) -> None:
    """A worker connected from 10.0.0.5 advertises this machine's HTTP server: no request reaches it, and
    the refusal is a transport error (a failed source: the notice's signer gets ``unavailable``)."""
    async def main() -> None:
        hits: list[str] = []

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            hits.append(request.path)
            return await handler(request)

        store = BlobStore(tmp_path / "s")
        key = SigningKey.generate()
        src_file = tmp_path / "f"
        src_file.write_bytes(b"x" * 5000)
        cid, _ = store.add_file(src_file, key, chunk_size=1024)
        app = web.Application(middlewares=[count])
        app.add_routes(blob_routes(store))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
        book = PeerBook("me")
        book.set_connected("honest", True, remote_ip="127.0.0.1")
        book.set_connected("mallory", True, remote_ip="10.0.0.5")
        src = HttpChunkSource(addresses=_policy([f"http://127.0.0.1:{port + 1}"], book))
        try:
            with pytest.raises(AddressRefused) as refused:
                await src.get_manifest(StaticProvider("mallory", f"http://127.0.0.1:{port}"), cid)
            assert hits == []
            assert public_reason(refused.value) == "the provider's address is not its own"
            raw = await src.get_manifest(StaticProvider("honest", f"http://127.0.0.1:{port}"), cid)
            assert raw == store.manifest_bytes(cid) and len(hits) == 1
        finally:
            src.close()
            await runner.cleanup()

    asyncio.run(main())


def test_public_reason_carries_no_remote_text() -> None:
    secret = "cannot connect to 10.0.0.9:6379: ConnectionRefusedError(111, 'Connection refused')"
    for exc in (TransportError(secret), asyncio.TimeoutError(), OSError(secret), ValueError(secret)):
        assert "10.0.0.9" not in public_reason(exc) and "6379" not in public_reason(exc)
