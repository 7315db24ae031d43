"""The libp2p host: identity from the node key, Noise mandatory, and the trio/asyncio bridge."""

from __future__ import annotations

import asyncio

import pytest
import trio

from intellect_node.errors import TransportError
from intellect_node.p2p.bridge import TrioThread
from intellect_node.protocol.signing import SigningKey
from tests.support.swarm import run, swarm_nodes


def _dial(addr: str, secure: str) -> str:
    """Dial ``addr`` from a throwaway libp2p host that speaks only ``secure`` (noise | plaintext)."""
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    kp = create_new_key_pair()
    sec = ({TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)} if secure == "plaintext"
           else {TProtocol(NOISE_ID): NoiseTransport(kp, noise_privkey=x25519().private_key)})
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(key_pair=kp, sec_opt=sec, listen_addrs=listen)

    async def main() -> str:
        async with host.run(listen_addrs=listen):
            try:
                with trio.fail_after(10):
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
            except trio.TooSlowError:
                return "timeout"
            except Exception as exc:  # what a refused handshake looks like to the dialer
                return f"refused: {type(exc).__name__}"
            return "connected"

    return trio.run(main)


def test_identity_is_the_node_key_and_plaintext_dialers_are_refused() -> None:
    async def main() -> None:
        async with swarm_nodes(1) as (node,):
            key = node.key
            addr = node.listen_addrs()[0]
            assert addr.startswith("/ip4/127.0.0.1/tcp/") and addr.endswith(f"/p2p/{key.peer_id}")
            assert node.peer_id == key.peer_id == SigningKey(key.seed).peer_id
            plain = await asyncio.to_thread(_dial, addr, "plaintext")
            assert plain.startswith("refused"), plain
            assert node.connected_peers() == []
            noise = await asyncio.to_thread(_dial, addr, "noise")
            assert noise == "connected"

    run(main(), 60)


def test_bridge_calls_errors_and_cancellation() -> None:
    async def main() -> None:
        bridge = TrioThread()
        cancelled = trio.Event()

        async def root(nursery: trio.Nursery, _b: TrioThread) -> None:
            return None

        async def add(a: int, b: int) -> int:
            await trio.sleep(0)
            return a + b

        async def fail() -> None:
            raise TransportError("boom")

        async def forever() -> None:
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()

        await bridge.start(root)
        try:
            assert await bridge.call(add, 2, 3) == 5
            with pytest.raises(TransportError, match="boom"):
                await bridge.call(fail)
            task = asyncio.ensure_future(bridge.call(forever))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Cancelling the asyncio caller cancels the trio task too.
            for _ in range(100):
                if cancelled.is_set():
                    break
                await asyncio.sleep(0.02)
            assert cancelled.is_set()
        finally:
            assert await bridge.astop(5.0)
        with pytest.raises(TransportError):
            await bridge.call(add, 1, 1)

    run(main(), 30)
