"""The node services a role finds beside it: the blob service and the ledger."""

from __future__ import annotations

from intellect_node.blobs.service import BlobService
from intellect_node.config.ledger import Ledger, LedgerService
from intellect_node.errors import ConfigError
from intellect_node.roles.common.seams import Runtime


def blob_service(runtime: Runtime) -> BlobService:
    for svc in runtime.services:
        if isinstance(svc, BlobService):
            return svc
    raise ConfigError("the RL roles need the blob service; add it before the role", field="services")


def ledger_of(runtime: Runtime) -> Ledger | None:
    """The node's ledger, or None when it runs without one (in-process tests)."""
    for svc in runtime.services:
        if isinstance(svc, LedgerService):
            return svc.ledger
    return None
