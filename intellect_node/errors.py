"""The one exception tree of intellect-node.

    IntellectNodeError
     +-- ConfigError        operator input is wrong (bad flag, bad field); the CLI exits with code 2
     +-- ProtocolError      bytes from a peer (or a file) do not decode to a valid message
     |    +-- MessageIgnored  well-formed and signed, but not to act on now (stale, a repeat): no blame
     +-- TransportError     a peer could not be reached, timed out, or broke a stream
     |    +-- ChunkUnavailable  the provider does not hold that blob part (ask another; no penalty)
     +-- IntegrityError     content did not match its hash (a chunk, a blob, a checkpoint), or weights
     |                      to be written are not finite
     +-- ProofRejected      a rollout or result failed verification (``reason`` says why)

Third-party exceptions are translated at the boundary: ``raise ProtocolError(...) from exc``.
"""

from __future__ import annotations


class IntellectNodeError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(IntellectNodeError):
    """Operator input is wrong. The message names the field or flag and the fix."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ProtocolError(IntellectNodeError):
    """Input from a peer (or a file written by one) is malformed, oversize or badly signed."""


class MessageIgnored(ProtocolError):
    """A gossip message that is well-formed and correctly signed but that no receiver acts on now: the
    gossip validator drops it without forwarding it and holds it against no one, neither its signer (a
    replay is not the signer's doing) nor the peer that forwarded it (which may have checked it a moment
    earlier, or with another clock). ``kind`` says which: ``"stale"`` (dated outside the receiver's
    window: a replay, or clocks minutes apart) or ``"repeat"`` (one already taken, again)."""

    def __init__(self, message: str, *, kind: str = "stale") -> None:
        super().__init__(message)
        self.kind = kind


class TransportError(IntellectNodeError):
    """A remote call failed: unreachable, timed out, reset."""


class ChunkUnavailable(TransportError):
    """The provider does not hold that chunk, manifest or bitmap (HTTP 404, or the chunk stream's "not
    held"): ask someone else, no penalty."""


class IntegrityError(IntellectNodeError):
    """Bytes did not match the content hash they were fetched or announced under."""


class ProofRejected(IntellectNodeError):
    """Verification failed. ``reason`` is a short machine-readable code, the message explains."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
