"""intellect-node: an open client for permissionless, decentralized RL of language models.

Layers (imports flow one way, bottom up; ``tests/test_layering.py`` checks it):

    errors, fsutil        no project imports
    protocol/             wire formats only (msgspec, hashes, signatures; no torch, libp2p or trio)
    proofs/               pure tensor math on hidden states and logits it is given
    trainer/, research/   tasks, rewards, losses, optimizer steps, checkpoints; no networking
    node/                 composes the rest into roles; owns host, blob store, engines, status
    commands/, cli.py, dashboard.py   the operator's layer (typer, rich)
"""

__version__ = "0.1.0"
