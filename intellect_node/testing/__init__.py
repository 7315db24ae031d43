"""Test harness shipped with the package, like ``trio.testing``: honest infrastructure that the tests and
``bench/`` share, never imported by the node itself (``tests/test_layering.py`` ranks it above every
other part, so nothing in the product may import it).

- :mod:`~intellect_node.testing.netns`: Linux network-namespace topologies (public hosts on a bridge,
  NAT routers, private hosts behind them) and the processes running in them;
- :mod:`~intellect_node.testing.nat_agent`: a small libp2p peer with the node's NAT services, driven by
  JSON lines, that stands in for a remote peer in those topologies;
- :mod:`~intellect_node.testing.models`: random-weight model folders of the real families;
- :mod:`~intellect_node.testing.roles`: the RL roles in one process, behind fakes of the swarm, the
  runtime and the fetcher, alone or several on one event loop (``InProcessSwarm``).

Dishonest peers (cheating workers, forgers, floods) are not here: they live in ``tests/support``.
"""
