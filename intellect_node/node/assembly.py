"""What a node runs: the one place where a :class:`~intellect_node.node.runtime.NodeRuntime` is put
together from its services.

Every node that ``intellect-node join`` starts runs the common services, in this order (services start
in order and close in reverse):

1. the ledger (``config/ledger.py``): first, so it closes after the roles that record in it and its
   write-ahead log is checkpointed last;
2. metrics (``node/metrics.py``), when ``[metrics] enabled``;
3. reachability (``p2p/nat``, docs/nat.md), before blobs: a private provider's chunks come over libp2p
   (its chunk source), and it serves this node's chunks from the blob store to peers that cannot reach
   our HTTP port;
4. blobs (``blobs/service.py``), with its collection of the blobs the node no longer keeps
   (``roles/common/pins.py``) every 10 minutes;
5. runs (``roles/runs.py``): lists, serves and announces the runs held in ``<data-dir>/runs/`` (nothing
   for a node that holds none);
6. the audit watch (``roles/common/audits.py``): the run's audit state from its auditors' verdicts, and
   with ``run.require_audits`` the refusal the roles after it consult;

then its RL roles (``--role``: :func:`intellect_node.roles.role_factory`), then any further services
(a test's cheating worker). Sweep nodes run only their sweep service (:func:`sweep_worker_node`,
:func:`sweep_coordinator_node`): a sweep moves no blobs and keeps no ledger.

Callers: ``commands/join.py``, ``commands/sweep.py``, the tests' node launchers and ``bench/``.
Role modules (torch) are imported only when a role is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from intellect_node.config import NodeConfig
from intellect_node.node.runtime import NodeRuntime, ServiceFactory

if TYPE_CHECKING:
    from intellect_node.roles.sweep import SweepCoordinatorService, SweepWorker


def add_common_services(runtime: NodeRuntime) -> None:
    """Add the services every joined node runs (ledger, metrics, NAT, blobs, runs, audits; see the
    module docstring)."""
    from intellect_node.blobs.service import BlobService
    from intellect_node.config.ledger import LedgerService
    from intellect_node.node.metrics import MetricsService
    from intellect_node.p2p.nat.service import NatService
    from intellect_node.roles.common.pins import GC_MIN_AGE_S, published_pins

    runtime.add_service(LedgerService.for_runtime)
    if runtime.config.metrics.enabled:
        runtime.add_service(MetricsService.for_runtime)
    nat: list[NatService] = []  # built at start; the blob service below needs it

    def reachability(rt: NodeRuntime) -> NatService:
        nat.append(NatService.for_runtime(rt))
        return nat[0]

    runtime.add_service(reachability)

    def blobs(rt: NodeRuntime) -> BlobService:
        svc = BlobService.from_swarm(rt.swarm, rt.data_dir, board=rt.board, extra_sources=[nat[0].source])
        nat[0].attach_blob_store(lambda: svc.store)
        rt.spawn("blob-gc", lambda: svc.collect_loop(lambda: published_pins(rt.data_dir),
                                                     min_age=GC_MIN_AGE_S), essential=False)
        return svc

    runtime.add_service(blobs)
    from intellect_node.roles.runs import RunsService

    runtime.add_service(RunsService.for_runtime)
    from intellect_node.roles.common.feed import FeedService

    runtime.add_service(FeedService.for_runtime)
    from intellect_node.roles.common.audits import AuditWatch

    runtime.add_service(AuditWatch.for_runtime)


def build_node(config: NodeConfig, data_dir: Path, *, roles: Sequence[str] = (),
               services: Sequence[ServiceFactory] = (), labels: Sequence[str] = (),
               common: bool = True) -> NodeRuntime:
    """A node, not started yet: ``common`` services (when True), the RL ``roles`` (each once, in the
    order given), then ``services``.

    ``labels``: what else the node says it is (status board, heartbeats), for services that are not
    roles (``sweep-worker``) or stand in for one (a test's cheating ``worker``). A role that is not one
    of :data:`intellect_node.roles.ROLES` raises ConfigError here, before anything starts."""
    from intellect_node.roles import role_factory

    names = list(dict.fromkeys(roles))
    factories = [role_factory(r) for r in names]
    if names:  # a role that clearly does not fit in memory is refused now, not killed minutes in
        from intellect_node.roles.common.engines import check_fits
        from intellect_node.roles.common.models import model_dir

        check_fits(config, names, model_dir(config))
    runtime = NodeRuntime(config, data_dir, roles=[*names, *labels])
    if common:
        add_common_services(runtime)
    for factory in [*factories, *services]:
        runtime.add_service(factory)
    return runtime


def sweep_worker_node(config: NodeConfig, data_dir: Path, *, coordinators: set[str],
                      worker: Callable[..., "SweepWorker"] | None = None) -> NodeRuntime:
    """A sweep worker (``intellect-node sweep worker``): claims jobs of ``coordinators``' sweeps (any
    coordinator's when empty). ``worker``: the class to run, :class:`~intellect_node.roles.sweep.SweepWorker`
    unless a test fields a dishonest one."""
    if worker is None:
        from intellect_node.roles.sweep import SweepWorker

        worker = SweepWorker
    make = worker
    return build_node(config, data_dir, labels=["sweep-worker"], common=False,
                      services=[lambda rt: make(rt.swarm, coordinators=set(coordinators))])


def sweep_coordinator_node(config: NodeConfig, data_dir: Path,
                           coordinator: Callable[[NodeRuntime], "SweepCoordinatorService"]) -> NodeRuntime:
    """The node of a sweep's coordinator (``intellect-node sweep polysemanticity``), running the service
    ``coordinator(runtime)`` builds."""
    return build_node(config, data_dir, labels=["sweep-coordinator"], common=False, services=[coordinator])
