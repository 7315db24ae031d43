"""intellect-node: an open client for permissionless, decentralized RL of language models.

The package is layered (imports flow one way, bottom up): the layer table, what each package holds and
its rank, is in docs/architecture.md; ``tests/test_layering.py`` checks the imports against those ranks
and ``tests/test_docs_map.py`` checks the table against them.
"""

__version__ = "0.1.0"
