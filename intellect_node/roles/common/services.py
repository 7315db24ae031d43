"""The node services a role finds beside it: the blob service and the ledger (looked up by their class)."""

from __future__ import annotations

from intellect_node.blobs.service import BlobService
from intellect_node.config.ledger import Ledger, LedgerService
from intellect_node.errors import ConfigError
from intellect_node.roles.common.seams import Runtime


def blob_service(runtime: Runtime) -> BlobService:
    svc = runtime.service(BlobService)
    if svc is None:
        raise ConfigError("the RL roles need the blob service; add it before the role", field="services")
    return svc


def ledger_of(runtime: Runtime) -> Ledger | None:
    """The node's ledger, or None when it runs without one (in-process tests)."""
    svc = runtime.service(LedgerService)
    return svc.ledger if svc is not None else None
