"""Hostile peers for the RL-role tests, on the project's own runtime and signing.

``python -m tests.support.hostile MODE DATA_DIR`` runs one as a child process (config from
``DATA_DIR/config.toml``, as ``join``); the ``flood`` and ``tarpit`` peers also run in an in-process swarm
(``intellect_node.testing.roles``) as an :class:`Attacker` on a node serving its :class:`Tarpit`'s routes:

- ``flood``: publishes well-formed, signed notices as fast as gossip carries them (8 a second), in turn
  for a blob it "holds" but serves a byte a second (tarpit), for a version far in the future, and for
  the next version (which parks);
- ``tarpit``: one notice every 2.5 s (within the per-peer notice rate), each for a blob it tarpits;
- ``stamp``: a validator that accepts every notice without looking (a faulty or lying validator the
  trainer was told to trust); ``stamp-outsider`` also vouches once for a batch of a worker that is not
  on the run's allowlist.

As processes these peers run the real :class:`~intellect_node.node.runtime.NodeRuntime` (heartbeats carry
their HTTP URL, so validators fetch from them directly) but none of the product's blob service: their bulk
HTTP routes are the tarpit. Cheating code lives here, not in the product.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

log = logging.getLogger("hostile")

TARPIT_SIZE = 30_000
"""Announced size of a tarpit batch (about an honest small batch's)."""
TARPIT_EVERY_S = 2.5
"""Seconds between the ``tarpit`` peer's notices."""
FLOOD_PER_S = 8.0
"""The ``flood`` peer's notices a second: the most one node publishes on a topic
(``p2p.swarm.PUBLISH_RATE_PER_TOPIC``, which paces it in a process; in an in-process swarm, whose publish
does not wait, the attacker paces itself)."""


class Tarpit:
    """Serves every blob request a byte a second, forever (until the client gives up)."""

    def __init__(self) -> None:
        self.requests = 0

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/blob/v1/{kind}/{cid}", self._drip)]

    async def _drip(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           "Content-Length": "2000"})
        await resp.prepare(request)
        try:
            for _ in range(2000):
                await resp.write(b"\0")
                await asyncio.sleep(1.0)
        except (ConnectionError, RuntimeError):  # the client gave up: what a tarpit wants
            pass
        return resp


class Attacker:
    """Publishes hostile notices (``flood`` or ``tarpit``) once a policy version is known, for blobs that
    ``tarpit`` serves (a node serves :meth:`routes`: in a process as a service's, in an in-process swarm
    as the node's ``routes``)."""

    name = "attacker"

    def __init__(self, runtime: Any, mode: str, tarpit: Tarpit | None = None) -> None:
        self.rt = runtime
        self.mode = mode
        self.tarpit = tarpit or Tarpit()
        self.newest = -1
        self.sent: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def routes(self) -> list[web.RouteDef]:
        return self.tarpit.routes()

    async def start(self) -> None:
        from intellect_node.protocol.policy import POLICY_KIND, announcement_validator
        from intellect_node.protocol.topics import topic

        cfg = self.rt.config
        self.rt.swarm.subscribe(topic(cfg.run.run_id, POLICY_KIND),
                                announcement_validator(cfg.run.run_id, cfg.run.trainer_peer_id),
                                self._on_policy)
        self._task = asyncio.create_task(self._loop())

    def _on_policy(self, ann: Any, origin: str) -> None:
        self.newest = max(self.newest, ann.version)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "newest": self.newest, "sent": dict(self.sent),
                "tarpit_requests": self.tarpit.requests}

    async def _loop(self) -> None:
        from intellect_node.protocol.ids import cid_of
        from intellect_node.protocol.rl import NOTICE_KIND, RolloutNotice, seal_notice
        from intellect_node.protocol.topics import topic

        sw, run_id = self.rt.swarm, self.rt.config.run.run_id
        while self.newest < 0:
            await asyncio.sleep(0.1)
        kinds = ["tarpit", "far_future", "next_version"] if self.mode == "flood" else ["tarpit"]
        i = 0
        while True:
            kind = kinds[i % len(kinds)]
            i += 1
            version = {"tarpit": self.newest, "far_future": self.newest + 1000,
                       "next_version": self.newest + 1}[kind]
            notice = RolloutNotice(run_id=run_id, batch_cid=cid_of(os.urandom(16)), policy_version=version,
                                   n_rollouts=8, batch_bytes=TARPIT_SIZE)
            await sw.publish(topic(run_id, NOTICE_KIND), seal_notice(sw.key, notice))
            self.sent[kind] = self.sent.get(kind, 0) + 1
            # The tarpit peer: a steady trickle (its queue fills slowly, strikes come slowly).
            await asyncio.sleep(TARPIT_EVERY_S if self.mode == "tarpit" else 1.0 / FLOOD_PER_S)


class Stamp:
    """A validator that accepts every notice unseen (``outsider``: and vouches for a stranger once)."""

    name = "stamp"

    def __init__(self, runtime: Any, outsider: bool) -> None:
        self.rt = runtime
        self.outsider = outsider
        self.stamped = 0

    async def start(self) -> None:
        from intellect_node.protocol.rl import NOTICE_KIND, notice_validator
        from intellect_node.protocol.topics import topic

        run_id = self.rt.config.run.run_id
        self.rt.swarm.subscribe(topic(run_id, NOTICE_KIND), notice_validator(run_id), self._on_notice)

    async def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"stamped": self.stamped}

    async def _on_notice(self, msg: Any, origin: str) -> None:
        from intellect_node.protocol.ids import cid_of
        from intellect_node.protocol.rl import VERDICT_KIND, BatchVerdict, seal_verdict
        from intellect_node.protocol.signing import SigningKey
        from intellect_node.protocol.topics import topic

        notice, worker = msg
        sw, run_id = self.rt.swarm, self.rt.config.run.run_id
        verdicts = [BatchVerdict(run_id=run_id, batch_cid=notice.batch_cid, worker=worker,
                                 policy_version=notice.policy_version, accepted=True,
                                 n_accepted=notice.n_rollouts, n_rejected=0)]
        if self.outsider and self.stamped == 0:
            verdicts.append(BatchVerdict(run_id=run_id, batch_cid=cid_of(os.urandom(16)),
                                         worker=SigningKey.generate().peer_id,
                                         policy_version=notice.policy_version,
                                         accepted=True, n_accepted=notice.n_rollouts, n_rejected=0))
        self.stamped += 1
        for v in verdicts:
            await sw.publish(topic(run_id, VERDICT_KIND), seal_verdict(sw.key, v))


def _main(mode: str, data_dir: Path) -> int:
    from tests.support.roles import run_custom_node

    # None of the common services (no blob service: the bulk routes are the tarpit's), only the attack.
    if mode in ("flood", "tarpit"):
        return run_custom_node(data_dir, "worker", [lambda rt: Attacker(rt, mode)], common=False)
    if mode in ("stamp", "stamp-outsider"):
        outsider = mode == "stamp-outsider"
        return run_custom_node(data_dir, "validator", [lambda rt: Stamp(rt, outsider=outsider)], common=False)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} flood|tarpit|stamp|stamp-outsider DATA_DIR")
    sys.exit(_main(sys.argv[1], Path(sys.argv[2])))
