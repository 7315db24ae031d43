"""node.assembly, the one place a node is put together: the common services in their order, then the
roles, then further services; sweep nodes run only their sweep service; a wrong role fails before start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from intellect_node.config import build_config
from intellect_node.errors import ConfigError
from intellect_node.node.assembly import build_node, sweep_worker_node
from intellect_node.node.runtime import NodeRuntime
from intellect_node.roles.common.services import blob_service, ledger_of
from intellect_node.roles.sweep import SweepWorker
from tests.support.swarm import run


class Extra:
    """A further service (what a test's cheating worker is): added after the common ones."""

    name = "extra"

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _cfg(metrics: bool) -> Any:
    return build_config(network={"http_host": "127.0.0.1", "heartbeat_interval": 2.0, "peer_timeout": 8.0},
                        run={"run_id": "assembly"}, metrics={"enabled": metrics})


def _names(rt: NodeRuntime) -> list[str]:
    return [s.name for s in rt.services]  # type: ignore[attr-defined]  # ours all have one; NodeService asks none


def test_a_joined_node_runs_the_common_services_in_order_then_the_rest(tmp_path: Path) -> None:
    async def main() -> None:
        rt = build_node(_cfg(metrics=True), tmp_path / "a", services=[Extra], labels=["worker"])
        await rt.start()
        try:
            # The ledger first (it closes last, after the roles that record in it); NAT before blobs; the
            # runs it lists after the blobs it serves them from, and its feed beside them; the audit watch
            # before the roles that ask it.
            assert _names(rt) == ["ledger", "metrics", "nat", "blobs", "runs", "feed", "audits", "extra"]
            assert rt.board.snapshot().role == "worker"
            # What a role finds beside it, by class (roles/common/services.py).
            assert blob_service(rt) is rt.services[3] and rt.service(Extra) is rt.services[7]
            ledger = ledger_of(rt)
            assert ledger is not None and rt.service(SweepWorker) is None
        finally:
            await rt.stop()
        rt = build_node(_cfg(metrics=False), tmp_path / "b")
        await rt.start()
        try:
            assert _names(rt) == ["ledger", "nat", "blobs", "runs", "feed", "audits"]
            assert rt.service(Extra) is None
        finally:
            await rt.stop()

    run(main(), timeout=120)


def test_a_sweep_worker_runs_only_its_sweep_service(tmp_path: Path) -> None:
    async def main() -> None:
        rt = sweep_worker_node(_cfg(metrics=False), tmp_path / "w", coordinators={"12D3KooWexample"})
        await rt.start()
        try:
            assert _names(rt) == ["sweep_worker"]
            assert rt.services[0].coordinators == {"12D3KooWexample"}  # type: ignore[attr-defined]  # the sweep worker's service
            assert rt.board.snapshot().role == "sweep-worker"
        finally:
            await rt.stop()

    run(main(), timeout=120)


def test_a_wrong_role_fails_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'miner' is not one of trainer, worker, validator") as err:
        build_node(_cfg(metrics=False), tmp_path / "c", roles=["worker", "miner"])
    assert err.value.field == "role"
    assert not (tmp_path / "c").exists()  # no data dir, key or lock was made
