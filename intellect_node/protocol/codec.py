"""The canonical encoding and strict decoding shared by every wire message.

Encoding is msgpack via msgspec with deterministic map order. Decoding is strict: the size limit is
checked before any allocation, unknown fields are refused, and the input must be *the* canonical
encoding of what it decodes to (re-encoding gives the same bytes), so a signature over the bytes is a
signature over the message and nothing else.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from intellect_node.errors import ProtocolError

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder(order="deterministic")


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of wire structs: immutable, unknown fields refused."""


def encode(obj: object) -> bytes:
    """The one canonical encoding of ``obj``."""
    return _ENCODER.encode(obj)


_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}  # by type: each decoder's own


def decode(data: bytes | bytearray | memoryview, type_: type[T], *, max_size: int) -> T:
    """Decode ``data`` as ``type_``; any malformed, oversize or non-canonical input raises ProtocolError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_size}")
    dec = _DECODERS.get(type_)
    if dec is None:
        dec = _DECODERS[type_] = msgspec.msgpack.Decoder(type_)
    try:
        obj: T = dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"cannot decode {getattr(type_, '__name__', type_)}: {exc}") from exc
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # defensive: msgspec edge cases
        raise ProtocolError(f"cannot decode {getattr(type_, '__name__', type_)}: {exc}") from exc
    if _ENCODER.encode(obj) != bytes(data):
        raise ProtocolError(f"{getattr(type_, '__name__', type_)} is not canonically encoded")
    return obj
