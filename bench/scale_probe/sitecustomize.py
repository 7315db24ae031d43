"""Bench-only probe: what an idle node sends and receives, by kind (``bench/scale_profile.py``).

Python imports ``sitecustomize`` at start from the first folder on its path that holds one, so a node
started with this folder first on ``PYTHONPATH`` and ``SCALE_PROBE_DIR`` set counts, on top of the
product's own fixes (installed here first, as the node would, so these wrappers sit outside them):

- pubsub RPCs written and read, by what they carry (published messages by topic, subscriptions, each
  control kind, the signed peer record), and their bytes;
- Noise transport messages written and read, with the yamux frame type each carries (one yamux frame
  per Noise message: ``Yamux._write_frame`` writes header and body in one call);
- new streams opened (``BasicHost.new_stream``) and accepted (multistream negotiation) by protocol;
- signed peer records checked on receipt (``maybe_consume_signed_record``, pubsub's import).

Every 2 s a daemon thread writes the cumulative counters with a monotonic time stamp to
``$SCALE_PROBE_DIR/<pid>.json``; the bench takes the difference over its window. Nothing of the product
imports this; a node without the variable runs unprobed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libp2p.abc import IHost, IMultiselectCommunicator, INetStream
    from libp2p.custom_types import StreamHandlerFn, TProtocol
    from libp2p.peer.id import ID
    from libp2p.pubsub.pb.rpc_pb2 import RPC
    from libp2p.security.noise.io import BaseNoiseMsgReadWriter

if os.environ.get("SCALE_PROBE_DIR"):
    import collections
    import json
    import threading
    import time

    counts: collections.Counter[str] = collections.Counter()
    _lock = threading.Lock()

    def _add(key: str, n: int = 1) -> None:
        with _lock:
            counts[key] += n

    def _install() -> None:
        from libp2p.host.basic_host import BasicHost
        from libp2p.protocol_muxer.multiselect import Multiselect
        from libp2p.pubsub import pubsub as pubsub_mod
        from libp2p.pubsub.pubsub import Pubsub
        from libp2p.security.noise.io import NoiseTransportReadWriter

        from intellect_node.p2p import compat

        compat.apply_fixes()
        yamux_types = {0: "data", 1: "window_update", 2: "ping", 3: "go_away"}

        def classify(prefix: str, rpc: RPC, size: int) -> None:
            _add(f"{prefix}.rpc")
            _add(f"{prefix}.bytes", size)
            kinds = []
            for msg in rpc.publish:
                kinds.append("publish:" + "/".join(t.rsplit("/", 2)[-2] for t in msg.topicIDs))
            if rpc.subscriptions:
                kinds.append("subscriptions")
            if rpc.HasField("control"):
                c = rpc.control
                for name in ("ihave", "iwant", "graft", "prune", "idontwant"):
                    if len(getattr(c, name)):
                        kinds.append(name)
            if rpc.HasField("senderRecord"):
                _add(f"{prefix}.with_record")
                _add(f"{prefix}.record_bytes", len(rpc.senderRecord))
            for k in kinds or ["empty"]:
                _add(f"{prefix}.kind.{k}")

        stock_write = Pubsub.write_msg

        async def write_msg(self: Pubsub, stream: INetStream, rpc_msg: RPC) -> bool:
            classify("pubsub_out", rpc_msg, rpc_msg.ByteSize())
            return await stock_write(self, stream, rpc_msg)

        Pubsub.write_msg = write_msg  # type: ignore[method-assign]  # the probe wraps the class's own

        stock_consume = pubsub_mod.maybe_consume_signed_record

        def consume(msg: RPC, host: IHost, peer_id: ID) -> bool:
            classify("pubsub_in", msg, msg.ByteSize())
            return stock_consume(msg, host, peer_id)

        pubsub_mod.maybe_consume_signed_record = consume

        stock_nw = NoiseTransportReadWriter.write_msg
        stock_nr = NoiseTransportReadWriter.read_msg

        async def noise_write(self: BaseNoiseMsgReadWriter, msg: bytes, prefix_encoded: bool = False) -> None:
            _add("noise_out.msg")
            if len(msg) >= 12:
                _add(f"noise_out.yamux.{yamux_types.get(msg[1], msg[1])}")
            return await stock_nw(self, msg, prefix_encoded)

        async def noise_read(self: BaseNoiseMsgReadWriter, prefix_encoded: bool = False) -> bytes:
            out = await stock_nr(self, prefix_encoded)
            _add("noise_in.msg")
            if len(out) >= 12 and out[0] == 0:
                _add(f"noise_in.yamux.{yamux_types.get(out[1], out[1])}")
            return out

        NoiseTransportReadWriter.write_msg = noise_write  # type: ignore[method-assign]  # wrapped, as above
        NoiseTransportReadWriter.read_msg = noise_read  # type: ignore[method-assign]  # restored / wrapped as above

        stock_new = BasicHost.new_stream

        async def new_stream(self: BasicHost, peer_id: ID, protocol_ids: Sequence[TProtocol],
                             *args: Any, **kwargs: Any) -> INetStream:
            _add(f"stream_out.{protocol_ids[0] if protocol_ids else '?'}")
            return await stock_new(self, peer_id, protocol_ids, *args, **kwargs)

        BasicHost.new_stream = new_stream  # type: ignore[method-assign]  # wrapped, as above

        stock_negotiate = Multiselect.negotiate

        async def negotiate(self: Multiselect, communicator: IMultiselectCommunicator,
                            *args: Any, **kwargs: Any) -> tuple[TProtocol | None, StreamHandlerFn | None]:
            proto, handler = await stock_negotiate(self, communicator, *args, **kwargs)
            _add(f"stream_in.{proto}")
            return proto, handler

        Multiselect.negotiate = negotiate  # type: ignore[method-assign]  # wrapped, as above

    def _dump_loop(path: str) -> None:
        while True:
            time.sleep(2.0)
            with _lock:
                snap = dict(counts)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"t": time.monotonic(), "counts": snap}, f)
            os.replace(tmp, path)

    try:
        _install()
    except Exception as exc:  # a probe that cannot install must say so, not measure nothing quietly
        raise SystemExit(f"scale probe: {exc!r}") from exc
    threading.Thread(target=_dump_loop, args=(os.path.join(os.environ["SCALE_PROBE_DIR"],
                                                            f"{os.getpid()}.json"),),
                     daemon=True, name="scale-probe").start()
