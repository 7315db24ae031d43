"""The trainer's policy publication: each new version out once, in order, and the newest repeated.

A version is published from the canonical copy of its weights taken right after its optimizer step
(``PolicyPublisher.publish``: delta/full blobs and a signed announcement, ``roles/common/policy.py``),
beside the next optimizer step: :meth:`Publication.next` starts it as one of the role's jobs, and the
next step waits for it (:meth:`Publication.wait`) before it makes another version, so publications run
one at a time, in version order. The announcement's bytes are also written to
``trainer/announcement.bin``.

Gossip is not stored, so :meth:`Publication.repeat` announces the newest version again every
:data:`REANNOUNCE_S` seconds for late joiners, and provides its blobs in the DHT again whenever more
peers are connected than when they were last provided (a provider record made while no peer was
connected reaches nobody).

Nothing here references the trainer: it hands in the publisher, the swarm and the role's tasks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from intellect_node.config.status import StatusBoard
from intellect_node.errors import IntellectNodeError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import PolicyAnnouncement
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.roles.common.seams import RoleSwarm, RoleTasks

log = logging.getLogger(__name__)

REANNOUNCE_S = 2.0
"""Seconds between repeats of the newest announcement (gossip is not stored: late joiners need it)."""
ANNOUNCEMENT_FILE = "announcement.bin"


class Publication:
    """Publishes versions through ``publisher`` on ``topic`` (the run's ``policy`` topic)."""

    def __init__(self, publisher: PolicyPublisher, swarm: RoleSwarm, topic: str, directory: Path,
                 board: StatusBoard, tasks: RoleTasks, snapshot: Callable[[], PolicyWeights]) -> None:
        self.publisher = publisher
        self._swarm = swarm
        self._topic = topic
        self._file = directory / ANNOUNCEMENT_FILE
        self._board = board
        self._tasks = tasks
        self._snapshot = snapshot  # the model's weights now, in canonical bytes (worker thread)
        self._announcement: tuple[PolicyAnnouncement, bytes] | None = None  # the newest version's
        self._publishing: asyncio.Task[None] | None = None
        self.published: dict[str, float] = {}
        """The last finished publication: version, time, seconds (``publish_s``), the publisher's timings."""

    async def current(self, version: int, state: PolicyWeights | None = None) -> None:
        """Make sure ``version`` is published, and announce it. ``state``: that version's weights (the
        model may have moved on since); None only when the version was published before or the model
        still holds it."""
        held = self.publisher.version
        # Published before a restart: the publisher signs its announcement again (the same bytes).
        got = self.publisher.announcement() if held is not None and held >= version else None
        if got is None:
            if state is None:
                state = await asyncio.to_thread(self._snapshot)
            got = await self.publisher.publish(version, state)
        self._announcement = got
        raw = got[1]
        await asyncio.to_thread(atomic_write_bytes, self._file, raw)
        await self._swarm.publish(self._topic, raw)

    def next(self, version: int, state: PolicyWeights) -> None:
        """Publish ``version`` beside the next step (whose :meth:`wait` comes first)."""
        self._publishing = self._tasks.job(self._in_background(version, state),
                                           f"publishing policy v{version}")

    async def wait(self) -> None:
        """Until the publication :meth:`next` started last has finished (at once when none has)."""
        if self._publishing is not None:
            await self._publishing

    async def _in_background(self, version: int, state: PolicyWeights) -> None:
        t0 = time.monotonic()
        try:
            await self.current(version, state)
        except asyncio.CancelledError:
            raise
        except Exception:  # keep training: the next step (or a restart) publishes again
            log.exception("publishing policy v%d failed", version)
            return
        self.published = {"version": version, "time": time.time(), "publish_s": time.monotonic() - t0,
                          **self.publisher.timings}
        self._board.set_policy(current=version, local=version)

    async def repeat(self) -> None:
        """Announce the newest version again every :data:`REANNOUNCE_S` (a loop; see the module docstring)."""
        provided: tuple[int, int] = (-1, -1)  # (version, connected peers) when the blobs were last provided
        while True:
            await asyncio.sleep(REANNOUNCE_S)
            if self._announcement is None:
                continue
            ann, raw = self._announcement
            await self._swarm.publish(self._topic, raw)
            peers = len(self._swarm.connected_peers())
            if (ann.version, peers) != provided and peers > provided[1]:
                for cid in [ann.full_cid, *(link.delta_cid for link in ann.deltas)]:
                    try:
                        await self._swarm.provide(cid)
                    except IntellectNodeError as exc:
                        log.info("re-providing %s failed: %s", cid, exc)
                provided = (ann.version, peers)
            elif peers < provided[1]:
                provided = (provided[0], peers)
