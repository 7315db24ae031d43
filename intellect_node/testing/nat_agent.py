"""A small libp2p node for the NAT tests and bench/nat.py, run inside a network namespace by
:mod:`intellect_node.testing.netns` (``python -m intellect_node.testing.nat_agent``).

Test harness (``intellect_node.testing``), never imported by the node. It stands in for a remote peer, so
it builds a bare py-libp2p host (``p2p/nat/bare.py``: the node's fixes applied, only ``p2p/`` touches
py-libp2p) instead of a whole node.

It runs a real host (TCP, Noise, Yamux), the Kademlia DHT and this project's NAT services
(intellect_node.p2p.nat), and takes JSON-line commands on stdin; each reply is one JSON line on stdout
with ``reply_to``. Events (``ready``, ...) are JSON lines with ``event``. Not a test itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Awaitable, Callable

import trio
from multiaddr import Multiaddr

from intellect_node.p2p.nat import autonat as autonat_mod
from intellect_node.p2p.nat import chunk_stream, dcutr, relay
from intellect_node.p2p.nat.bare import bare_host, in_background, peer_info
from intellect_node.p2p.nat.bare import peer as peer_id

ECHO = "/intellect-test/echo/1.0.0"


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Node:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.relay_client: relay.RelayClient | None = None
        self.nursery: trio.Nursery | None = None
        self.listen = Multiaddr(f"/ip4/{args.ip}/tcp/{args.port}")

        self.host, self.dht = bare_host(args.name, self.listen, dht_server=args.public)
        self.autonat = autonat_mod.DialBackAutoNAT(self.host, serve=args.public)
        self.relay_service: relay.RelayService | None = None
        self.dialer = relay.CircuitDialer(self.host)
        self.dcutr: dcutr.HolePuncher | None = None
        self.chunks = chunk_stream.ChunkStreamServer(self.host, self._lookup_chunk,
                                                     relay_limits=self._relay_budget)
        self.store: dict[str, bytes] = {}

    def _relay_budget(self, relay_peer: str) -> int | None:
        if self.relay_client is not None:
            return self.relay_client.data_limit(relay_peer)
        return None

    async def _lookup_chunk(self, kind: str, cid: str) -> bytes | None:
        return self.store.get(cid) if kind == "chunk" else None

    async def run(self) -> None:
        async with self.host.run(listen_addrs=[self.listen]), trio.open_nursery() as nursery:
            self.nursery = nursery
            await nursery.start(self._run_service, self.dht)
            if self.args.relay:
                limits = relay.RelayServiceLimits(
                    max_reservations=self.args.max_reservations, max_circuits=self.args.max_circuits,
                    max_bytes=self.args.max_bytes, max_duration_s=self.args.max_duration,
                    reservation_ttl_s=self.args.reservation_ttl)
                self.relay_service = relay.RelayService(self.host, self.dht, limits,
                                                        advertise_interval_s=2.0)
                await nursery.start(self.relay_service.run)
            if self.args.dcutr:
                self.dcutr = dcutr.HolePuncher(self.host)
                await nursery.start(self.dcutr.run)
            if not self.args.public:  # what a node does once AutoNAT has said PRIVATE
                relay.advertise_circuit_addrs(
                    self.host, lambda: self.relay_client.circuit_addrs() if self.relay_client else [])
            self.chunks.register()
            self.host.set_stream_handler(ECHO, self._echo)
            emit({"event": "ready", "peer_id": str(self.host.get_id()),
                  "addrs": [str(a) for a in self.host.get_addrs()]})
            await self._serve_commands(nursery)
            nursery.cancel_scope.cancel()

    @staticmethod
    async def _run_service(service: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with in_background(service):
            task_status.started()
            await trio.sleep_forever()

    async def _echo(self, stream: Any) -> None:
        try:
            while True:
                data = await stream.read(65536)
                if not data:
                    break
                await stream.write(data)
        except Exception:
            await stream.reset()
            return
        await stream.close()

    async def _serve_commands(self, nursery: trio.Nursery) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        while True:
            data = await stdin.receive_some(65536)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                nursery.start_soon(self._dispatch, req)

    async def _dispatch(self, req: dict[str, Any]) -> None:
        op = req.pop("op")
        rid = req.pop("id")
        handler: Callable[..., Awaitable[dict[str, Any]]] = getattr(self, f"op_{op}")
        try:
            result = await handler(**req)
            emit({"reply_to": rid, "ok": True, **result})
        except Exception as exc:  # the test sees the error text
            emit({"reply_to": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    # --- commands ------------------------------------------------------------------------------------

    async def op_connect(self, addr: str) -> dict[str, Any]:
        info = peer_info(addr)
        with trio.fail_after(10):
            await self.host.connect(info)
        await self.dht.routing_table.add_peer(info.peer_id)
        return {}

    async def op_autonat(self, servers: list[str], min_confirmations: int = 2) -> dict[str, Any]:
        relayed = self.relay_client is not None and bool(self.relay_client.held)
        report = await self.autonat.check([peer_id(s) for s in servers],
                                          min_confirmations=min_confirmations, relayed=relayed)
        return {"status": report.status.value, "successes": report.successes, "failures": report.failures,
                "no_verdict": report.no_verdict, "fix": report.fix, "public_addrs": list(report.public_addrs)}

    async def op_relay_client(self, want: int = 2, renew_fraction: float = 0.5,
                              check_interval: float = 0.5) -> dict[str, Any]:
        assert self.nursery is not None
        self.relay_client = relay.RelayClient(self.host, self.dht, want=want, renew_fraction=renew_fraction,
                                              check_interval_s=check_interval)
        await self.nursery.start(self.relay_client.run)
        return {}

    async def op_relay_state(self) -> dict[str, Any]:
        assert self.relay_client is not None
        snap = self.relay_client.snapshot()
        return {"relays": [r.relay for r in snap.reservations],
                "expires": [r.expires_at for r in snap.reservations],
                "renewals": snap.renewals, "circuit_addrs": list(snap.circuit_addrs),
                "addrs": [str(a) for a in self.host.get_addrs()]}

    async def op_relay_stats(self) -> dict[str, Any]:
        assert self.relay_service is not None
        s = self.relay_service.snapshot()
        return {"reservations": s.reservations, "circuits": s.active_circuits}

    async def op_dial(self, addrs: list[str], timeout: float = 15.0) -> dict[str, Any]:
        t0 = time.monotonic()
        peer = await self.dialer.connect_addrs(addrs, timeout=timeout)
        return {"peer": peer, "seconds": time.monotonic() - t0}

    async def op_conns(self, peer: str) -> dict[str, Any]:
        return {"kinds": relay.connection_kinds(self.host, peer_id(peer))}

    async def op_echo(self, peer: str, size: int = 1024) -> dict[str, Any]:
        pid = peer_id(peer)
        payload = os.urandom(size)
        t0 = time.monotonic()
        with trio.fail_after(30):
            stream = await self.host.new_stream(pid, [ECHO])
            got = bytearray()

            async def reader() -> None:
                while len(got) < size:
                    data = await stream.read(65536)
                    if not data:
                        break
                    got.extend(data)

            async with trio.open_nursery() as n:
                n.start_soon(reader)
                for i in range(0, size, 65536):
                    await stream.write(payload[i:i + 65536])
            await stream.close()
        if bytes(got) != payload:
            raise RuntimeError(f"echo returned {len(got)} of {size} bytes or different bytes")
        kinds = relay.connection_kinds(self.host, pid)
        return {"seconds": time.monotonic() - t0, "kinds": kinds}

    async def op_punch(self, peer: str) -> dict[str, Any]:
        assert self.dcutr is not None
        t0 = time.monotonic()
        ok = await self.dcutr.upgrade(peer_id(peer))
        return {"direct": ok, "seconds": time.monotonic() - t0,
                "kinds": relay.connection_kinds(self.host, peer_id(peer))}

    async def op_put(self, size: int, n: int = 1) -> dict[str, Any]:
        from intellect_node.protocol.ids import cid_of

        cids = []
        for _ in range(n):
            data = os.urandom(size)
            cid = cid_of(data)
            self.store[cid] = data
            cids.append(cid)
        return {"cids": cids}

    async def op_fetch(self, peer: str, cids: list[str]) -> dict[str, Any]:
        client = chunk_stream.ChunkStreamClient(self.host, peer_id(peer))
        t0 = time.monotonic()
        total = 0
        for cid in cids:
            data = await client.get_chunk(cid)
            self.store[cid] = data
            total += len(data)
        return {"bytes": total, "seconds": time.monotonic() - t0,
                "kinds": relay.connection_kinds(self.host, peer_id(peer))}

    async def op_provide(self, key: str) -> dict[str, Any]:
        ok = await self.dht.provide(key)
        return {"ok_provide": ok}

    async def op_find(self, key: str) -> dict[str, Any]:
        found = await self.dht.find_providers(key)
        return {"providers": sorted({str(p.peer_id) for p in found}),
                "addrs": {str(p.peer_id): [str(a) for a in p.addrs] for p in found}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--ip", required=True)
    p.add_argument("--port", type=int, default=4001)
    p.add_argument("--public", action="store_true", help="DHT server and AutoNAT server")
    p.add_argument("--relay", action="store_true")
    p.add_argument("--dcutr", action="store_true")
    p.add_argument("--max-reservations", type=int, default=8)
    p.add_argument("--max-circuits", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024)
    p.add_argument("--max-duration", type=int, default=600)
    p.add_argument("--reservation-ttl", type=int, default=3600)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("intellect_node").setLevel(logging.DEBUG)
    # libp2p's loggers do not propagate to the root logger: attach the handler where we want detail.
    if os.environ.get("NAT_AGENT_DEBUG"):
        for name in os.environ["NAT_AGENT_DEBUG"].split(","):
            lg = logging.getLogger(name)
            lg.setLevel(logging.DEBUG)
            lg.addHandler(logging.getLogger().handlers[0])
    trio.run(Node(args).run)


if __name__ == "__main__":
    main()
