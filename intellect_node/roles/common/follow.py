"""The run's policy as a worker or validator follows it: :class:`TrainerPolicy`.

Both roles need the same thing: the newest version the run's trainer announced, held locally and loaded into
an engine. :class:`TrainerPolicy` subscribes to the run's ``policy`` topic, where only the run's trainer may
announce (``protocol.policy.announcement_validator`` drops everyone else's in the gossip validator), shows
each announcement to the role (the validator judges staleness by the newest one), and offers it to a
:class:`~intellect_node.roles.common.policy.PolicyFollower`, whose ``follow`` loop obtains the newest version
offered, newest wins, retrying a failed one a few times
(:data:`~intellect_node.roles.common.policy.FOLLOW_RETRIES`, from :data:`RETRY_S` doubling). The trainer
repeats its newest announcement every couple of seconds, and each repeat is offered again, so a version given
up on is tried again at the next repeat. The role gets every version obtained as ``on_version(version,
checkpoint)``, and at start the version already held on disk.

With ``run.require_audits`` on and the trainer failing an audit (``roles/common/audits.py``), no newer
version is adopted: announcements are no longer offered to the follower (``refused_announcements``
counts them), a version obtained after the refusal began is not handed to the role, and one whose load
was under way when it began is dropped by the role before use (``refused_after_load``, asked by the
worker and the validator before they adopt a loaded version, unless they hold none).

Policy blobs come from the trainer first (it holds every one), the DHT second (``HintedFetcher``).
Version 0 is built from the node's own copy of the run's model folder when its hash is the trainer's
(``PolicyFollower``'s ``base``): at a run's start no node fetches the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement, announcement_validator
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.audits import audit_gate
from intellect_node.roles.common.fetch import HintedFetcher
from intellect_node.roles.common.models import MAX_POLICY_BYTES, model_dir
from intellect_node.roles.common.policy import ObtainResult, PolicyFollower
from intellect_node.roles.common.run import require_trainer
from intellect_node.roles.common.seams import RoleTasks, Runtime
from intellect_node.trainer.model import initial_policy

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""The first wait before a version that could not be obtained is tried again (it doubles)."""

OnVersion = Callable[[int, PolicyWeights], Awaitable[None]]


class TrainerPolicy:
    """The run's trainer's policy, followed in ``directory`` for one role (see the module docstring).

    ``on_version`` is awaited with each version obtained, in increasing order; ``on_announcement`` sees
    every valid announcement first (repeats included) and must not block. With ``keep_passing`` k it is
    also awaited with each of the k versions before an obtained one that the delta walk passed through
    (a validator holds every version it may be asked to judge, not only the newest)."""

    def __init__(self, runtime: Runtime, fetcher: HintedFetcher, directory: Path, tasks: RoleTasks,
                 on_version: OnVersion, *,
                 on_announcement: Callable[[PolicyAnnouncement], None] | None = None,
                 keep_passing: int = 0) -> None:
        self.run_id = runtime.config.run.run_id
        self.trainer = require_trainer(runtime.config, tasks.name)
        self._rt = runtime
        self._tasks = tasks
        self._on_version = on_version
        self._on_announcement = on_announcement
        self.refusal = audit_gate(runtime)  # "" while the trainer may be followed
        self.refused_announcements = 0
        self.follower = PolicyFollower(directory, fetcher.holding([self.trainer]), run_id=self.run_id,
                                       trainer=self.trainer, max_checkpoint_bytes=MAX_POLICY_BYTES,
                                       board=runtime.board, on_reject=runtime.swarm.peerbook.record_rejection,
                                       on_passing=on_version, keep_passing=keep_passing,
                                       base=partial(initial_policy, model_dir(runtime.config)))

    @property
    def version(self) -> int | None:
        """The version held here (None before the first)."""
        return self.follower.version

    async def start(self) -> None:
        """Hand the role the version held on disk, then subscribe and follow the announcements."""
        held, ckpt = self.follower.version, self.follower.checkpoint
        if held is not None and ckpt is not None:
            await self._on_version(held, ckpt)
        validate = announcement_validator(self.run_id, self.trainer)
        self._rt.swarm.subscribe(topic(self.run_id, POLICY_KIND), validate, self._heard)
        self._tasks.loop(f"{self._tasks.name}-policy", self._follow)

    def _heard(self, ann: PolicyAnnouncement, origin: str) -> None:
        if self._on_announcement is not None:
            self._on_announcement(ann)
        if self.refusal():
            self.refused_announcements += 1
            return
        self.follower.offer(ann)

    async def _follow(self) -> None:
        await self.follower.follow(self._obtained, backoff_s=RETRY_S)

    def refused_after_load(self, version: int, *, holding: bool) -> bool:
        """Whether ``version``, loaded by the role while the trainer failed an audit, must be dropped rather
        than adopted; a role ``holding`` no policy yet still takes it."""
        why = self.refusal()
        if not why or not holding:
            return False
        log.warning("policy v%d loaded but not adopted: %s", version, why)
        return True

    async def _obtained(self, res: ObtainResult) -> None:
        if self.refusal():
            log.warning("policy v%d obtained but not loaded: %s", res.version, self.refusal())
            return
        await self._on_version(res.version, res.checkpoint)
        log.info("policy v%d loaded (%s, %d bytes fetched)", res.version, res.path, res.bytes_fetched)
