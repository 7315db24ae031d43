"""intellect-node: an open client for permissionless, decentralized RL of language models.

Layers (imports flow one way, bottom up; ``tests/test_layering.py`` checks it; docs/architecture.md):

    errors, fsutil        no project imports
    protocol/             wire formats only (msgspec, hashes, signatures; no torch, libp2p or trio)
    proofs/               pure tensor math on hidden states and logits it is given
    models/               Hugging Face model folders and tokenizers, loaded offline
    trainer/, research/   tasks, rewards, losses, optimizer steps, checkpoints; sweeps; no networking
    inference/            engines (torch, vLLM), rollouts, verification; no networking
    p2p/                  libp2p host, swarm facade, peerbook, heartbeats, NAT (the only libp2p importer)
    blobs/                content-addressed chunk store, bulk HTTP, fetch
    roles/                worker, validator, trainer, policy distribution, sweep services
    node/                 runtime, config, status, control API, ledger, metrics: what runs a node
    commands/, cli.py, dashboard.py   the operator's layer (typer, rich)
    testing/              shipped test harness (netns topologies, NAT agent); the product never imports it
"""

__version__ = "0.1.0"
