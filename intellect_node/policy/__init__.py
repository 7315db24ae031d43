"""The policy format every role reads: a version's canonical weights (``weights.py``: one safetensors
layout, its content hash is the version's CID) and the deltas between versions (``delta.py``). Workers and
validators apply them; the trainer writes them. Imports ``protocol/`` and nothing above it."""
