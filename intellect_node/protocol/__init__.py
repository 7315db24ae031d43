"""Wire formats: msgspec structs, versioned protocol IDs and topics, one canonical encoding, signatures.

Nothing here imports torch, libp2p or trio. Every decoder raises only :class:`ProtocolError`.
One module per protocol, each declaring its structs, its protocol ID or topic and its maximum size.
"""

from intellect_node.errors import ProtocolError

__all__ = ["ProtocolError"]
