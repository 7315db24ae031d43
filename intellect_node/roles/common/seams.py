"""What a role uses of the node around it (:class:`Runtime`, :class:`RoleSwarm`) and how it keeps its tasks
(:class:`RoleTasks`).

``node/runtime.py``'s ``NodeRuntime`` sits above the roles (it assembles them), so the roles cannot import
it; they are written against these Protocols instead, which name the few things they use of the node and
of its swarm (``p2p.swarm.Swarm`` is the one that runs). Tests and other assemblies can hand a role
anything that has them (``tests/security/_roles_inproc.py`` has a fake swarm).

A role runs two kinds of tasks. Its long-lived loops run under the node's supervisor (``runtime.spawn``:
restarted with a back-off when they fail). Its short jobs (one peer's batch check, a ban, a policy
publication) run in one :class:`asyncio.TaskGroup` that a supervised task holds open for the role's
lifetime; a job's failure is logged at its edge and never spreads to the others. :meth:`RoleTasks.close`
ends both, so a role's ``close`` does not keep task lists of its own, and no job outlives the resources
(fetcher, blob store) the role closes next.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

from intellect_node.aioutil import cancel_and_wait
from intellect_node.config import NodeConfig
from intellect_node.config.status import StatusBoard
from intellect_node.p2p.swarm import Handler, Provider, Validate
from intellect_node.protocol.signing import SigningKey

log = logging.getLogger(__name__)

LoopFactory = Callable[[], Awaitable[object]]
"""A loop the supervisor can start again: called once per (re)start, its state lives on its object."""
S = TypeVar("S")


class RolePeerbook(Protocol):
    """What a role does with the peerbook: blame a peer, ban it at once, look up its bulk HTTP URL."""

    def record_rejection(self, peer_id: str, reason: str, *, counts: bool = True) -> int: ...

    def ban(self, peer_id: str, reason: str) -> None: ...

    def is_banned(self, peer_id: str) -> bool: ...

    def http_url(self, peer_id: str) -> str: ...


class RoleSwarm(Protocol):
    """What a role uses of the swarm (docs/architecture.md, "Swarm facade", has the whole facade)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def key(self) -> SigningKey: ...

    @property
    def peerbook(self) -> RolePeerbook: ...

    async def publish(self, topic: str, data: bytes) -> None: ...

    def subscribe(self, topic: str, validate: Validate, handler: Handler, *,
                  include_own: bool = False) -> None: ...

    async def ban(self, peer: str, reason: str) -> None: ...

    def is_banned(self, peer: str) -> bool: ...

    def connected_peers(self) -> list[str]: ...

    async def provide(self, cid: str) -> None: ...

    async def find_providers(self, cid: str, *, count: int = 20) -> list[Provider]: ...


class Runtime(Protocol):
    """The node as a role sees it (``node.runtime.NodeRuntime`` is the one that runs; see
    docs/architecture.md, "Node runtime"). The role is built after the swarm started, so ``swarm`` is set."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def board(self) -> StatusBoard: ...

    @property
    def swarm(self) -> RoleSwarm: ...

    @property
    def data_dir(self) -> Path: ...

    def service(self, kind: type[S]) -> S | None:
        """The node's service of class ``kind`` built so far, or None (``roles/common/services.py``)."""
        ...

    def spawn(self, name: str, factory: LoopFactory, *, essential: bool = True,
              may_end: bool = False) -> asyncio.Task[None]:
        """Run ``factory()`` for the node's lifetime, restarted when it fails; cancel the task to stop it."""
        ...


class RoleService(Protocol):
    """A role as the node runs it: started once the swarm runs, closed once, and read for the node's
    status (``GET /v1/status`` serves :meth:`status` under the role's ``name``)."""

    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> Mapping[str, object]: ...


class RoleFactory(Protocol):
    """What ``roles.role_factory`` returns for a ``--role``: the role's ``for_runtime``, which builds it for
    the node it runs in."""

    def __call__(self, runtime: Runtime, /) -> RoleService: ...


class RoleTasks:
    """One role's loops (the supervisor's) and jobs (a task group); see the module docstring."""

    def __init__(self, runtime: Runtime, name: str) -> None:
        self._rt = runtime
        self.name = name
        self._loops: list[asyncio.Task[None]] = []
        self._group: asyncio.TaskGroup | None = None
        self._opened = asyncio.Event()

    def loop(self, name: str, factory: LoopFactory, *, may_end: bool = False) -> asyncio.Task[None]:
        """Run a long-lived loop under the node's supervisor until :meth:`close`."""
        task = self._rt.spawn(name, factory, may_end=may_end)
        self._loops.append(task)
        return task

    async def open(self) -> None:
        """Start the task group jobs run in; returns once :meth:`job` takes them."""
        self.loop(f"{self.name}-jobs", self._hold)
        await self._opened.wait()

    async def _hold(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._opened.set()
            try:
                await asyncio.get_running_loop().create_future()  # until cancelled by close()
            finally:
                self._group = None  # the group is cancelling its jobs: take no new ones

    def job(self, coro: Coroutine[object, None, None], what: str) -> asyncio.Task[None] | None:
        """Run ``coro`` beside the role's other jobs; its failure is logged (``what`` failed) and goes no
        further. None (and ``coro`` closed unrun) when the role is closing."""
        group = self._group
        if group is None:
            coro.close()
            log.debug("%s: not started, %s is closing", what, self.name)
            return None

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:  # the edge of one job: a bug on one peer's batch must not stop the others
                log.exception("%s failed", what)

        return group.create_task(guarded())

    async def close(self) -> None:
        """Cancel the loops and every job still running, and wait for them."""
        loops, self._loops = self._loops, []
        await cancel_and_wait(loops)
