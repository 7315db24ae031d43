"""The peer-to-peer layer: the only package that imports py-libp2p.

Holds the libp2p host on its trio thread (``host``, ``bridge``), the asyncio-side facade the rest of the
node uses (``swarm``), the connection manager that bounds connections by watermarks (``connmgr``), the
gossipsub settings for swarms of hundreds (``gossip_params``), the peerbook (liveness, rejections, bans),
heartbeats (``heartbeat``), the node identity (``identity``: key and data dir), the listening ports
(``ports``), the libp2p compatibility module (``compat``: every workaround of py-libp2p 0.8.1 with its
evidence and removal condition) and stream containment (``guard``), and reachability (``nat/``: AutoNAT,
circuit relay v2, DCUtR). May import: ``errors``, ``fsutil``, ``protocol``."""
