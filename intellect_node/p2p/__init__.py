"""The peer-to-peer layer: the only package that imports py-libp2p.

Holds the libp2p host on its trio thread (``host``, ``bridge``), the asyncio-side ``Swarm`` facade the
rest of the node uses, the peerbook (liveness, rejections, bans), heartbeats, the node identity (key and
data dir), the libp2p compatibility module (``compat``: every workaround of py-libp2p 0.8.1 with its
evidence and removal condition) and stream containment (``guard``), and reachability (``nat/``: AutoNAT,
circuit relay v2, DCUtR). May import: ``errors``, ``fsutil``, ``protocol``.
"""
