"""Helpers for tests/p2p/test_libp2p_fuzz.py: a target node with an honest peer, attacker hosts, checks.

- :func:`target_and_honest`: two full node runtimes on 127.0.0.1 (DHT, gossipsub, blob HTTP, the NAT
  services with the relay service on, so HOP/STOP/DCUtR/AutoNAT/chunk-stream handlers are all live),
  wired together and subscribed to one topic.
- :class:`Attackers`: raw py-libp2p hosts, a fresh identity each, on one trio thread of their own;
  ``await attackers.run(fn)`` runs ``fn(host, target_id)`` with a new host connected to the target.
- :func:`assert_serves`: the target still serves the honest peer: gossip delivered both ways, and a
  fresh blob found through a DHT provider lookup and fetched over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import trio

from tests.support.swarm import runtime_nodes
from tests.support.wait import wait_until

TOPIC = "/intellect/test/fuzz/1"


class Node:
    """A runtime plus what the checks need: its blob service and the gossip it received."""

    def __init__(self, rt: Any) -> None:
        from intellect_node.roles.common.services import blob_service

        self.rt = rt
        self.swarm = rt.swarm
        self.peer_id = rt.swarm.peer_id
        self.blobs = blob_service(rt)
        self.got: list[bytes] = []


@contextlib.asynccontextmanager
async def target_and_honest(root: Path) -> AsyncIterator[tuple[Node, Node]]:
    from intellect_node.blobs.service import BlobService
    from intellect_node.config.nat import NatConfig
    from intellect_node.p2p.nat.service import NatService

    made: list[Any] = []

    def nat(rt: Any) -> Any:
        # The target (started first) runs the relay service, so its HOP and STOP handlers are live (on
        # loopback AutoNAT never says PUBLIC). The honest node does not: otherwise the target would
        # reserve a slot with it after a few verdict-less checks and advertise a p2p:// blob URL.
        made.append(rt)
        relay: Literal["on", "off"] = "on" if len(made) == 1 else "off"
        return NatService(rt.swarm, NatConfig(relay_service=relay),
                          on_reject=rt.swarm.peerbook.record_rejection, board=rt.board)

    def blobs(rt: Any) -> Any:
        return BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board)

    async with runtime_nodes(root, 2, {0: [1]}, services=[nat, blobs], heartbeat_interval=5.0,
                             peer_timeout=30.0) as rts:
        target, honest = Node(rts[0]), Node(rts[1])
        for n in (target, honest):
            n.swarm.subscribe(TOPIC, lambda data, origin: data, lambda msg, origin, n=n: n.got.append(msg))
        await wait_until(lambda: honest.peer_id in target.swarm.topic_peers(TOPIC)
                         and target.peer_id in honest.swarm.topic_peers(TOPIC), 30, what="subscriptions")
        yield target, honest


async def assert_serves(target: Node, honest: Node, tag: str, tmp: Path) -> None:
    """Gossip both ways, then a new blob on the target: provided, found by the honest peer, fetched."""
    assert target.swarm.bridge.running, f"{tag}: the target's libp2p thread stopped"
    for src, dst in ((target, honest), (honest, target)):
        msg = f"{tag}: {src.peer_id[-6:]} -> {dst.peer_id[-6:]}".encode()
        await src.swarm.publish(TOPIC, msg)
        await wait_until(lambda: msg in dst.got, 20, what=f"{tag}: gossip {msg!r}")
    path = tmp / f"blob-{hashlib.sha256(tag.encode()).hexdigest()[:8]}.bin"
    path.write_bytes(tag.encode() + os.urandom(50_000))
    cid, _ = await target.blobs.put_file(path)

    # put_file announces in the background: look the provider up until the record is there.
    deadline = time.monotonic() + 20
    while target.peer_id not in [p.peer_id for p in await honest.swarm.find_providers(cid)]:
        assert time.monotonic() < deadline, f"{tag}: the honest peer did not find the blob through the DHT"
        await asyncio.sleep(0.25)
    out = tmp / f"{path.name}.out"
    await honest.blobs.fetch(cid, out=out)
    assert out.read_bytes() == path.read_bytes(), f"{tag}: blob differs"


def _new_host(seed: bytes) -> Any:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    kp = create_new_key_pair(hashlib.sha256(seed).digest())
    return new_host(key_pair=kp, sec_opt={PROTOCOL_ID: Transport(kp, x25519().private_key)})


class Attackers:
    """Attacker hosts on their own trio thread (the bridge the node uses, in the test's process)."""

    def __init__(self, target_addr: str) -> None:
        from intellect_node.p2p.bridge import TrioThread

        self.target_addr = target_addr
        self.bridge = TrioThread(name="attackers")
        self.count = 0

    async def __aenter__(self) -> "Attackers":
        async def root(nursery: trio.Nursery, _b: Any) -> None:
            return None

        await self.bridge.start(root)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bridge.astop()

    async def run(self, fn: Callable[[Any, Any], Awaitable[Any]], *, connect: bool = True) -> tuple[str, Any]:
        """``fn(host, target_peer_id)`` with a new attacker host (connected unless ``connect=False``);
        returns (the attacker's peer ID, what ``fn`` returned)."""
        self.count += 1
        seed = f"attacker-{self.count}-{os.getpid()}".encode()

        async def main() -> tuple[str, Any]:
            from libp2p.peer.peerinfo import info_from_p2p_addr
            from multiaddr import Multiaddr

            host = _new_host(seed)
            info = info_from_p2p_addr(Multiaddr(self.target_addr))
            async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                if connect:
                    with trio.fail_after(15):
                        await host.connect(info)
                return host.get_id().to_base58(), await fn(host, info.peer_id)

        return await self.bridge.call(main)


async def hit(host: Any, target: Any, protocol: str, payload: bytes, *, timeout: float = 3.0) -> str:
    """Open a ``protocol`` stream, send ``payload``, half-close, read what comes back until the target
    closes or resets (bounded). Returns "refused" when negotiation fails, else how the stream ended."""
    try:
        with trio.fail_after(10):
            stream = await host.new_stream(target, [protocol])
    except Exception:  # the target does not speak it, or refused us
        return "refused"
    end = "timeout"
    with trio.move_on_after(timeout):
        try:
            if payload:
                await stream.write(payload)
            await stream.close()
            got = 0
            while got < 1 << 20:
                data = await stream.read(1 << 16)
                if not data:
                    break
                got += len(data)
            end = "eof"
        except Exception as exc:  # a reset is what a contained failure looks like from here
            end = type(exc).__name__
    try:
        await stream.reset()
    except Exception:
        pass
    return end
