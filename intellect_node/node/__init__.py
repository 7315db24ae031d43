"""What runs one node: the runtime that assembles its services and supervises its tasks, the
configuration, status snapshots and health, the control API, the ledger, metrics, ports and systemd
notification. May import every layer below (``roles``, ``blobs``, ``p2p``, ``inference``, ...); only
``commands/``, ``cli.py`` and ``dashboard.py`` import it.
"""
