"""Reachability: AutoNAT, circuit relay v2, DCUtR hole punching and chunk transfer over libp2p streams.

``autonat`` asks several peers whether the world reaches us; ``dcutr`` turns a relayed connection into a
direct one; ``chunk_stream`` carries blob chunks over a libp2p stream for peers HTTP cannot reach;
``service`` is the node's reachability service that runs them (plugged in with ``runtime.add_service``);
``bare`` is a bare host with the node's fixes for the NAT test agent. See docs/nat.md. Everything here
runs on the trio thread next to the libp2p host."""
