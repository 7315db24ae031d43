"""What runs one node: the runtime that assembles its services and supervises its tasks, health, the
control API, metrics and systemd notification (its configuration, ledger and status board are
``config/``'s). May import every layer below (``roles``, ``blobs``, ``p2p``, ``inference``, ...); only
``commands/``, ``cli.py`` and ``dashboard.py`` import it.
"""
