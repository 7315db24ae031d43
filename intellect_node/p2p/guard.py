"""Containment: no input from a peer can stop this node's libp2p service.

py-libp2p 0.8.1 runs each connection's tasks (the yamux read loop, the stream accept loop and, under
it, every inbound stream's handler) inside the ``Swarm`` service; an exception a handler does not catch
stops the whole service: no more dials, gossip or DHT for every peer (six bytes on ``/meshsub/1.1.0``
were enough). Rather than wrap each handler of each protocol by hand, failures are caught where
the library hands work to code that reads peer input:

- :func:`contain_streams`: the network's one stream dispatcher (every inbound stream of every protocol
  passes it: multistream negotiation, then the protocol's handler). A failure resets that stream and,
  when the peer's input was at fault, records the reason against the peer; the node serves on.
- :class:`GuardedStream`: many library handlers (Kademlia, identify push, AutoNAT, relay HOP/STOP,
  DCUtR) catch their own parse errors and only log them, so nothing would ever be held against the
  sender. For those protocols the dispatcher hands the handler a stream that checks each of the first
  frames it reads (varint length within the protocol's limit, a protobuf of the protocol's message type)
  before the handler sees it; a malformed frame resets the stream and is recorded against the peer.
- :data:`MAX_INBOUND_STREAMS`: a connection's inbound streams still open to input are capped; the next
  is reset before negotiation and recorded against the peer.
- :func:`_finish`: a handler that returned on the peer's EOF without closing its own side (pubsub's read
  loop, the relay's HOP handler) gets it closed, so the muxer forgets the stream. Left half-open, each
  such stream stayed in its connection's table until the connection closed: as many as a peer cared to
  open and close, none counted by the cap above (the peer can no longer send on them).
- :func:`contained_connection_task`: a connection task that fails closes its own connection.
- :func:`contained_peer_task`: pubsub's per-message and per-peer tasks.

"At fault" (:func:`is_peer_fault`): anything but the ordinary ends of a network conversation (EOF,
reset, closed or broken connection, a timeout). An honest peer that crashes or stalls costs nothing;
one that sends what does not parse collects rejections, and the peerbook bans it after
``peerbook.AUTO_BAN_AFTER`` of them. A banned peer's new streams are reset before negotiation.

Cancellation is never caught: ``except Exception`` lets ``trio.Cancelled`` (a BaseException, also
inside exception groups) through.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import trio
from libp2p.abc import IHost, IMultiselectCommunicator, IMuxedConn, IMuxedStream, INetStream
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.stream.exceptions import StreamError
from libp2p.network.swarm import Swarm as LibSwarm
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectError
from libp2p.stream_muxer.exceptions import MuxedConnError, MuxedStreamError

log = logging.getLogger(__name__)

OnReject = Callable[[str, str], object]
"""``(peer_id, reason)``: the peerbook's ``record_rejection``."""

_ORDINARY = (StreamError, MuxedStreamError, MuxedConnError, ConnectionClosedError, IncompleteReadError,
             RawConnError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, EOFError,
             ConnectionError, TimeoutError)
"""How a conversation ends when a peer goes away, resets or stalls: not held against it."""


_BUG_LIKE = (AttributeError, TypeError, KeyError, IndexError, NameError, AssertionError)
"""Exceptions that usually mean a bug in a handler rather than bytes that do not parse."""


def is_peer_fault(exc: BaseException) -> bool:
    """True when ``exc`` says the peer sent something wrong (not just that it went away)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(is_peer_fault(e) for e in exc.exceptions)
    if isinstance(exc, MultiselectError):
        return _malformed_negotiation(exc)
    return not isinstance(exc, _ORDINARY)


def describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if is_peer_fault(e)] or list(exc.exceptions)
        return describe(leaves[0])
    text = str(exc).strip()
    cause = exc.__cause__
    if not text and cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _malformed_negotiation(exc: MultiselectError) -> bool:
    """Multistream failures that were the peer's bytes (bad header, unparsable line), not a timeout or a
    closed stream (the library wraps both in MultiselectError)."""
    if "mismatch" in str(exc):
        return True
    cause: BaseException | None = exc.__cause__
    while cause is not None and not isinstance(cause, _ORDINARY):
        if cause.__cause__ is None:
            # The root: ParseError (varint, length, missing newline) and the like.
            return type(cause).__name__ != "MultiselectCommunicatorError"
        cause = cause.__cause__
    return False


@dataclass(frozen=True)
class Containment:
    on_reject: OnReject
    is_banned: Callable[[str], bool]


_registry: "weakref.WeakKeyDictionary[object, Containment]" = weakref.WeakKeyDictionary()
"""Network (libp2p ``Swarm``) -> how its host records rejections; several hosts share a process in tests."""


def containment_of(network: object) -> Containment | None:
    try:
        return _registry.get(network)
    except TypeError:  # not weak-referenceable: not one of ours
        return None


def _reject(network: object, peer: str, what: str, exc: BaseException) -> None:
    reject_reason(network, peer, f"{what}: {describe(exc)}")


def reject_reason(network: object, peer: str, reason: str) -> None:
    c = containment_of(network)
    if c is not None and peer:
        try:
            c.on_reject(peer, reason)
        except Exception:  # recording must never become the failure
            log.exception("recording a rejection of %s failed", peer)
    else:
        log.info("input from %s refused: %s", peer or "an unknown peer", reason)


def _peer_of_stream(stream: INetStream) -> str:
    try:
        return stream.muxed_conn.peer_id.to_base58()
    except Exception:  # a stream of a half-built connection: nobody to blame
        return ""


async def _reset(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception as exc:  # already closed or the connection died: nothing left to release
        log.debug("reset: %r", exc)


CLOSE_TIMEOUT_S = 1.0
"""How long closing our side may take (one FIN frame; a peer that stops reading cannot hold the handler)."""


async def _finish(stream: INetStream) -> None:
    """After a handler returned normally: close our side of a stream whose peer has closed its own.

    Only then: a handler that returns while the peer may still send can have handed the stream on (the
    relay's STOP handler makes it a relayed connection); with the peer's side closed, nothing of ours
    reads it any more, and whatever still had to be written went out before the handler returned."""
    ms = getattr(stream, "muxed_stream", None)
    if ms is None or not getattr(ms, "recv_closed", False) or getattr(ms, "send_closed", True):
        return
    try:
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await stream.close()
    except Exception as exc:  # the connection died meanwhile: it takes the stream with it
        log.debug("close after handler: %r", exc)


MAX_INBOUND_STREAMS = 256
"""Inbound streams one connection may hold open (the peer has not closed its side) at once; the next is
reset before negotiation and recorded against the peer. Each can hold up to its yamux receive window
(256 KiB until its reader reads) that nobody may ever read: a handler that returned, a protocol that only
writes. 256 bounds that at 64 MiB a connection; the stock library bounds it nowhere. An honest node
keeps a few open (gossip, a DHT query or two, chunk requests, relayed circuits); go-libp2p's resource
manager and rust-yamux cap streams per peer or connection likewise."""

_inbound: "weakref.WeakKeyDictionary[IMuxedConn, weakref.WeakSet[IMuxedStream]]" = weakref.WeakKeyDictionary()
"""Muxed connection -> its inbound muxed streams dispatched and, when last looked at, open to input."""


def _receiving(muxed_stream: IMuxedStream) -> bool:
    """Whether the peer may still send on a muxed stream (yamux flags; what is already buffered stays
    bounded by the window)."""
    return not (getattr(muxed_stream, "recv_closed", True) or getattr(muxed_stream, "closed", True)
                or getattr(muxed_stream, "reset_received", True))


def _admit(stream: INetStream) -> bool:
    """Count ``stream`` against its connection's :data:`MAX_INBOUND_STREAMS`; False when it is over.

    Counted by muxed stream: the muxer holds it until both sides are done, while the ``NetStream`` may be
    collected as soon as its handler returns."""
    conn, ms = getattr(stream, "muxed_conn", None), getattr(stream, "muxed_stream", None)
    if conn is None or ms is None:
        return True
    try:
        live = _inbound.setdefault(conn, weakref.WeakSet())
        for s in list(live):
            if not _receiving(s):
                live.discard(s)
        if len(live) >= MAX_INBOUND_STREAMS:
            return False
        live.add(ms)
    except TypeError:  # not weak-referenceable: not a connection we can count
        pass
    return True


def contain_streams(host: IHost, on_reject: OnReject, is_banned: Callable[[str], bool]) -> None:
    """Route every inbound stream of ``host`` through the containment dispatcher (call once, before
    the host runs). Uses only public API: ``network.set_stream_handler`` and ``host.get_mux()``."""
    network = host.get_network()
    if not isinstance(network, LibSwarm):
        raise TypeError(f"stream containment needs libp2p's Swarm, not {type(network).__name__}")
    _registry[network] = Containment(on_reject, is_banned)
    inner = network.common_stream_handler  # the host's dispatcher: negotiate, then the protocol handler
    mux = host.get_mux()
    negotiate = mux.negotiate

    async def checked_negotiate(communicator: IMultiselectCommunicator, timeout: int | None = None
                                ) -> tuple[TProtocol | None, StreamHandlerFn | None]:
        try:
            protocol, handler = await (negotiate(communicator) if timeout is None
                                       else negotiate(communicator, timeout))
        except MultiselectError as exc:
            if _malformed_negotiation(exc):
                # The host swallows MultiselectError silently; ours reaches the dispatcher and is blamed.
                raise MalformedNegotiation(describe(exc)) from exc
            raise
        framing = framings().get(str(protocol))
        if framing is None or handler is None:
            return protocol, handler
        inner_handler = handler

        async def guarded(stream: INetStream) -> None:
            def bad(reason: str) -> None:
                reject_reason(network, _peer_of_stream(stream), f"{protocol}: {reason}")

            # A proxy: everything but ``read`` is the stream's own (GuardedStream.__getattr__).
            await inner_handler(cast(INetStream, GuardedStream(stream, framing, bad)))

        return protocol, guarded

    vars(mux)["negotiate"] = checked_negotiate  # this host's multiselect only, not the class

    async def dispatch(stream: INetStream) -> None:
        peer = _peer_of_stream(stream)
        if peer and is_banned(peer):
            await _reset(stream)
            return
        if not _admit(stream):
            reject_reason(network, peer, f"streams: more than {MAX_INBOUND_STREAMS} inbound streams open "
                                         "on one connection")
            await _reset(stream)
            return
        try:
            await inner(stream)
        except Exception as exc:  # per-stream edge: this stream and this peer only
            protocol = _protocol_of(stream)
            if is_peer_fault(exc):  # recorded before the peer can see the reset and send more
                # A bug's signature (not a parse error) is logged loudly: honest input may have hit it.
                level = logging.WARNING if isinstance(exc, _BUG_LIKE) else logging.DEBUG
                log.log(level, "stream %s from %s failed", protocol, peer, exc_info=True)
                _reject(network, peer, protocol, exc)
            else:
                log.debug("stream %s from %s ended: %r", protocol, peer, exc)
            await _reset(stream)
        else:
            await _finish(stream)

    network.set_stream_handler(dispatch)


class MalformedNegotiation(Exception):
    """A peer's multistream negotiation did not parse (wrong header, bad length prefix, bad line)."""


def _protocol_of(stream: INetStream) -> str:
    try:
        return str(stream.get_protocol() or "multistream")
    except Exception:  # before negotiation a stream has no protocol
        return "multistream"


class _Connection(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=_Connection)
O_ = TypeVar("O_")
P = ParamSpec("P")
R = TypeVar("R")


def contained_connection_task(fn: Callable[[C], Awaitable[None]], what: str
                              ) -> Callable[[C], Awaitable[None]]:
    """Wrap a connection's task (``SwarmConn.start``, ``Yamux.start``): a failure closes that connection
    (and is held against its peer when its input was at fault) instead of stopping the Swarm."""

    async def task(self: C) -> None:
        try:
            await fn(self)
        except Exception as exc:  # per-connection edge
            muxed = getattr(self, "muxed_conn", self)
            pid = getattr(muxed, "peer_id", None)
            peer = pid.to_base58() if pid is not None else ""
            log.warning("%s for %s failed, closing that connection: %r", what, peer or "?", exc)
            if is_peer_fault(exc):
                _reject(getattr(self, "swarm", None), peer, what, exc)
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                try:
                    await self.close()
                except Exception as close_exc:  # already half torn down
                    log.debug("closing after %s failure: %r", what, close_exc)

    task.__name__ = getattr(fn, "__name__", "start")
    task.__doc__ = fn.__doc__
    return task


def contained_peer_task(fn: Callable[Concatenate[O_, ID, P], Awaitable[R]], what: str
                        ) -> Callable[Concatenate[O_, ID, P], Awaitable[R | None]]:
    """Wrap a pubsub/gossipsub method run as a service task for one peer (``fn(self, peer_id, ...)``):
    a failure is held against that peer instead of stopping the pubsub service."""

    async def task(self: O_, peer: ID, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return await fn(self, peer, *args, **kwargs)
        except Exception as exc:  # per-peer edge
            from libp2p.pubsub.gossipsub import GossipSub
            from libp2p.pubsub.pubsub import Pubsub

            owner = self.pubsub if isinstance(self, GossipSub) else self
            # None: a router not attached to its pubsub yet
            network = owner.host.get_network() if isinstance(owner, Pubsub) else None
            try:
                name = peer.to_base58()
            except Exception:
                name = str(peer)
            if is_peer_fault(exc):
                log.debug("%s task for %s failed", what, name, exc_info=True)
                _reject(network, name, what, exc)
            else:
                log.debug("%s task for %s ended: %r", what, name, exc)
            return None

    task.__name__ = getattr(fn, "__name__", "task")
    task.__doc__ = fn.__doc__
    return task


@dataclass(frozen=True)
class Framing:
    """How a protocol's first frames look: varint-prefixed ``message`` protobufs of at most
    ``max_size`` bytes; ``frames`` of them are checked (None: every frame)."""

    message: type
    max_size: int
    frames: int | None


_FRAMINGS: dict[str, Framing] = {}


def framings() -> dict[str, Framing]:
    """Checked protocols, with the library's own size limits. Not listed: meshsub (its DecodeError
    reaches the dispatcher by itself), identify (we only write), ping (any 32 bytes are valid), ours."""
    if not _FRAMINGS:
        from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
        from libp2p.identity.identify.pb.identify_pb2 import Identify
        from libp2p.kad_dht.pb.kademlia_pb2 import Message as KadMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
        from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch

        _FRAMINGS.update({
            "/ipfs/kad/1.0.0": Framing(KadMessage, 4 << 20, None),
            "/ipfs/id/push/1.0.0": Framing(Identify, 1 << 20, 1),
            "/libp2p/autonat/1.0.0": Framing(AutoNATMessage, 64 << 10, 1),
            # After its first message a HOP/STOP stream carries the relayed connection's raw bytes.
            "/libp2p/circuit/relay/0.2.0/hop": Framing(HopMessage, 64 << 10, 1),
            "/libp2p/circuit/relay/0.2.0/stop": Framing(StopMessage, 64 << 10, 1),
            "/libp2p/dcutr": Framing(HolePunch, 4 << 10, 2),  # CONNECT, then SYNC
        })
    return _FRAMINGS


class GuardedStream:
    """A stream whose first frames are checked before its handler reads them (see the module doc).

    Everything but ``read`` is the wrapped stream's. A frame is read whole from the peer, checked, and
    then served to the handler from a buffer in whatever slices it asks for (a varint byte by byte,
    then the body)."""

    def __init__(self, stream: INetStream, framing: Framing, bad: Callable[[str], None]) -> None:
        self._stream = stream
        self._framing = framing
        self._bad = bad
        self._left = framing.frames
        self._buf = bytearray()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if not self._buf and self._left != 0:
            await self._next_frame()
        if self._buf:
            take = len(self._buf) if n is None or n < 0 else min(n, len(self._buf))
            out = bytes(self._buf[:take])
            del self._buf[:take]
            return out
        return await self._stream.read(n)

    async def _next_frame(self) -> None:
        from libp2p.network.stream.exceptions import StreamReset

        prefix = bytearray()
        length = 0
        for i in range(10):
            b = await self._stream.read(1)
            if not b:
                return  # the peer ended the stream: the handler sees that itself
            prefix += b
            length |= (b[0] & 0x7F) << (7 * i)
            if not b[0] & 0x80:
                break
        else:
            await self._refuse("length prefix longer than 10 bytes")
            raise StreamReset("malformed frame")
        if length > self._framing.max_size:
            await self._refuse(f"frame of {length} bytes over the limit of {self._framing.max_size}")
            raise StreamReset("malformed frame")
        body = bytearray()
        while len(body) < length:
            chunk = await self._stream.read(length - len(body))
            if not chunk:
                break  # truncated by the peer's end of stream: the handler sees the short frame
            body += chunk
        if len(body) == length:
            msg = self._framing.message()
            try:
                msg.ParseFromString(bytes(body))
            except Exception as exc:  # protobuf's DecodeError and friends: the peer's bytes are bad
                await self._refuse(f"malformed {type(msg).__name__}: {type(exc).__name__}")
                raise StreamReset("malformed frame") from exc
        if self._left is not None:
            self._left -= 1
        self._buf += prefix + body

    async def _refuse(self, reason: str) -> None:
        self._left = 0
        self._bad(reason)
        await _reset(self._stream)
