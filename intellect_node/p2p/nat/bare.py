"""A bare py-libp2p host with the node's fixes, for the NAT test agent (``testing/nat_agent.py``).

The agent stands in for a remote peer in the NAT tests and ``bench/nat.py``: a host (TCP, Noise, Yamux)
and the Kademlia DHT with this project's NAT services on top, not a whole node. Building it touches
py-libp2p directly, and only ``p2p/`` does that, so the pieces live here.
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractAsyncContextManager
from typing import Any

from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service
from libp2p.tools.anyio_service.api import ManagerAPI, ServiceAPI
from multiaddr import Multiaddr

from intellect_node.p2p.compat import apply_fixes as apply_libp2p_fixes


def bare_host(name: str, listen: Multiaddr, *, dht_server: bool) -> tuple[Any, KadDHT]:
    """A host whose key derives from ``name`` (the same name, the same peer ID) listening on ``listen``,
    and its DHT (a server when ``dht_server``)."""
    apply_libp2p_fixes()  # the same py-libp2p fixes as a real node (p2p/host.py)
    kp = create_new_key_pair(hashlib.sha256(name.encode()).digest())
    host = new_host(key_pair=kp, sec_opt={NOISE_ID: NoiseTransport(kp, create_x25519().private_key)},
                    listen_addrs=[listen])
    return host, KadDHT(host, DHTMode.SERVER if dht_server else DHTMode.CLIENT)


def peer(text: str) -> ID:
    """A peer ID from its base58 text."""
    return ID.from_base58(text)


def peer_info(addr: str) -> PeerInfo:
    """Peer ID and address of a full multiaddr ending ``/p2p/<id>``."""
    return info_from_p2p_addr(Multiaddr(addr))


def in_background(service: ServiceAPI) -> AbstractAsyncContextManager[ManagerAPI]:
    """Run a py-libp2p service (the DHT) for the duration of an ``async with``."""
    return background_trio_service(service)
