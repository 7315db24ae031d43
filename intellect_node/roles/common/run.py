"""What a worker or validator cannot start without: the run's trainer, and a place on a closed run's
allowlist."""

from __future__ import annotations

from intellect_node.config import NodeConfig
from intellect_node.errors import ConfigError


def require_trainer(cfg: NodeConfig, role: str) -> str:
    """The run's trainer peer ID, which a worker or validator cannot run without."""
    if not cfg.run.trainer_peer_id:
        raise ConfigError(f"a {role} needs the run's trainer: set run.trainer_peer_id (--trainer-peer-id)",
                          field="run.trainer_peer_id")
    return cfg.run.trainer_peer_id


def require_allowed(cfg: NodeConfig, peer_id: str) -> None:
    """A worker of a closed run (``run.worker_allowlist`` set) must be on the list: its batches would
    all be refused (``not_allowed``), so it is an operator error at start."""
    allow = cfg.run.worker_allowlist
    if allow and peer_id not in allow:
        raise ConfigError(f"this node ({peer_id}) is not on run.worker_allowlist ({len(allow)} peers); ask "
                          "the run's operator to add it, or join another run", field="run.worker_allowlist")
