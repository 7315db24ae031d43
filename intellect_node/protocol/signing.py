"""Signed envelopes: an ed25519 signature over a domain tag and the canonical bytes of one message.

The signer is named by its peer ID, which embeds its public key, so verification needs nothing else.
The domain tag (the message kind, e.g. ``"intellect/rollout/1"``) stops a signature made for one kind
of message being replayed as another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import peer_id_from_public_key, public_key_from_peer_id

T = TypeVar("T")

ENVELOPE_OVERHEAD = 256  # bytes an envelope adds around its payload, generously


class Envelope(codec.Message, frozen=True):
    domain: str
    payload: bytes
    signer: str  # peer ID of the signer
    signature: bytes


class SigningKey:
    """An ed25519 key pair as 32 seed bytes; the node key (the same seed is its libp2p identity)."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("an ed25519 seed has 32 bytes")
        self.seed = bytes(seed)
        self._sk = Ed25519PrivateKey.from_private_bytes(self.seed)
        self.public_key = self._sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> "SigningKey":
        import os

        return cls(os.urandom(32))

    def sign_bytes(self, domain: str, payload: bytes) -> bytes:
        return self._sk.sign(_signed_bytes(domain, payload))

    def seal(self, domain: str, message: object) -> bytes:
        """Encode ``message`` canonically, sign it, and return the encoded envelope."""
        payload = codec.encode(message)
        env = Envelope(domain=domain, payload=payload, signer=self.peer_id,
                       signature=self.sign_bytes(domain, payload))
        return codec.encode(env)


def _signed_bytes(domain: str, payload: bytes) -> bytes:
    d = domain.encode("utf-8")
    return len(d).to_bytes(2, "big") + d + payload


def verify_signature(signer: str, domain: str, payload: bytes, signature: bytes) -> None:
    """Raise ProtocolError unless ``signature`` is ``signer``'s over ``domain`` and ``payload``."""
    pub = public_key_from_peer_id(signer)
    if len(signature) != 64:
        raise ProtocolError("bad signature length")
    try:
        Ed25519PublicKey.from_public_bytes(pub).verify(signature, _signed_bytes(domain, payload))
    except InvalidSignature as exc:
        raise ProtocolError("bad signature") from exc


def open_envelope(data: bytes, domain: str, type_: type[T], *, max_size: int) -> tuple[T, str]:
    """Decode and verify an envelope; return the message and the signer's peer ID."""
    env = codec.decode(data, Envelope, max_size=max_size + ENVELOPE_OVERHEAD)
    if env.domain != domain:
        raise ProtocolError(f"envelope for {env.domain!r}, expected {domain!r}")
    verify_signature(env.signer, env.domain, env.payload, env.signature)
    return codec.decode(env.payload, type_, max_size=max_size), env.signer


class _RunScoped(Protocol):
    @property
    def run_id(self) -> str: ...


R = TypeVar("R", bound=_RunScoped)


def open_published(data: bytes, origin: str, domain: str, type_: type[R], *, max_size: int, run_id: str,
                   what: str, signers: frozenset[str] | None = None,
                   unlisted: Callable[[str], str] = lambda s: f"signed by {s}, not a listed signer"
                   ) -> tuple[R, str]:
    """What a gossip validator opens: an envelope signed by ``origin``, the peer that published it, of
    ``run_id``, and (with ``signers``) by one of them, else ``unlisted(signer)`` is the reason. ``what``
    names the message in errors. Returns ``(message, signer)``."""
    msg, signer = open_envelope(data, domain, type_, max_size=max_size)
    if signer != origin:
        raise ProtocolError(f"{what} signed by another peer than its publisher")
    if signers is not None and signer not in signers:
        raise ProtocolError(unlisted(signer))
    if msg.run_id != run_id:
        raise ProtocolError(f"{what} for run {msg.run_id[:128]!r}, this node is in {run_id!r}")
    return msg, signer


def open_from_trainer(data: bytes, domain: str, type_: type[R], *, max_size: int, run_id: str, trainer: str,
                      what: str) -> R:
    """Decode and verify an envelope only the run's trainer may sign (``what`` names it in errors): its
    signer must be ``trainer`` and its message of ``run_id``."""
    msg, signer = open_envelope(data, domain, type_, max_size=max_size)
    if signer != trainer:
        raise ProtocolError(f"{what} signed by {signer}, not the run's trainer")
    if msg.run_id != run_id:
        raise ProtocolError(f"{what} for run {msg.run_id[:128]!r}, this node is in {run_id!r}")
    return msg
