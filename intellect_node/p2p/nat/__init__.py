"""Reachability: AutoNAT, circuit relay v2, DCUtR hole punching and chunk transfer over libp2p streams.

See docs/nat.md. Everything here runs on the trio thread next to the libp2p host.
"""
