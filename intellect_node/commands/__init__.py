"""Command groups of the CLI; each module exposes ``register(app)``. See ``intellect_node/cli.py``."""
