"""What runs one node: the runtime that assembles its services and supervises its tasks, health, the
control API, metrics and systemd notification (its configuration, ledger and status board are
``config/``'s).

``assembly`` is the one place a node is put together from its services (``build_node``); ``runtime``
supervises them; ``processes`` starts nodes as child processes and talks to them (``warmstart`` forks
them from a server that imported torch and the node once); ``sdnotify`` speaks the systemd notification
protocol. May import every layer below (``roles``, ``blobs``, ``p2p``,
``inference``, ...); only ``commands/``, ``cli.py`` and ``dashboard.py`` import it."""
