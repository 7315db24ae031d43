"""A validator cannot be stalled by cheap notices (issue #12, part 4).

A trainer, a validator and an honest worker run until the validator has issued a few verdicts on the
honest worker's batches (the unloaded baseline, measured here, on this machine, now). Then two hostile
peers join (``tests.support.hostile.Attacker``): one floods well-formed signed notices (8 a second, for
blobs it tarpits, for versions far in the future and for the next version), the other sends a notice for
a tarpitted blob every 2.5 s. The honest worker's next verdicts must come within a few seconds of the
baseline; the attackers' unbacked notices are charged to them (``future``, ``unavailable``; the excess
refused as ``busy``/``flood`` is recorded, not a strike) and the flooder is banned.

In one process (``intellect_node.testing.roles``): the real roles on one event loop, the attackers'
notices through the validator's gossip validation and handler as a swarm delivers them, and every blob
over real HTTP on 127.0.0.1, the attackers' from a node whose bulk routes are a ``Tarpit`` (a byte a
second), so each tarpitted fetch runs into the validator's fetch deadline.

Before the intake (one loop, one notice at a time) each tarpitted blob held every verdict up for its 60 s
fetch timeout and each next-version notice for 30 s.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

import pytest

from intellect_node.config import NodeConfig
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import InProcessNode, InProcessSwarm, in_process_swarm, key_of, run_config
from tests.support.hostile import Attacker, Tarpit
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RL = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4, batches_per_version=1)
VALIDATOR = dict(strikes_ban_after=20)
"""Enough for the tarpitter to last the measurement (a strike per 10 s deadline); the flooder earns 20 in
seconds (its notices for far-future versions are strikes)."""
SAMPLES = 6
"""Honest verdicts measured before and during the attack."""
SLACK_MEDIAN_S = 2.0
SLACK_MAX_S = 4.0
"""How much later than the baseline an honest verdict may come under attack ("a few seconds")."""

ids = {name: key_of(name).peer_id for name in ("trainer", "validator", "worker", "flood", "tarpit")}


async def attacker(net: InProcessSwarm, name: str, cfg: NodeConfig) -> InProcessNode:
    """Node ``name`` running the hostile peer of that mode, its bulk HTTP routes the tarpit."""
    tarpit = Tarpit()
    return await net.start(name, cfg, lambda rt: Attacker(rt, name, tarpit), ledger=False,
                           routes=tarpit.routes())


def test_flooding_and_tarpitting_peers_barely_delay_honest_verdicts(tmp_path: Path) -> None:
    cfg = run_config(trainer=ids["trainer"], validators=[ids["validator"]], rl=RL)
    cfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update=VALIDATOR)})

    async def main() -> tuple[list[float], list[float], dict[str, Any], dict[str, Any], dict[str, Any],
                              dict[str, str]]:
        async with in_process_swarm(tmp_path) as net:
            await net.start("trainer", cfg, Trainer.for_runtime)
            validator = await net.start("validator", cfg, Validator.for_runtime)

            def vstat() -> dict[str, Any]:
                return validator.status()

            def honest() -> list[float]:
                return list(vstat()["latency_s"].get(ids["worker"], []))

            await net.start("worker", cfg, Worker.for_runtime)
            # The baseline skips the first verdict (it waited for the validator's first policy).
            await wait_until(lambda: len(honest()) >= SAMPLES + 1, timeout=300, what="baseline verdicts")
            baseline = honest()[1:SAMPLES + 1]

            flood = await attacker(net, "flood", cfg)
            tarpit = await attacker(net, "tarpit", cfg)

            def attacked() -> bool:
                strikes = vstat()["strikes_by_worker"]
                return bool(strikes.get(ids["flood"], 0) >= 1 and vstat()["unavailable"] >= 1)
            await wait_until(attacked, timeout=120,
                             what="both attacks under way (a flood refused, a tarpit timed out)")
            # The status keeps only a worker's 32 latest latencies, so count verdicts by the validator's
            # total; only the honest worker's batches can be accepted, and its latest latencies all come
            # from under attack.
            a0 = vstat()["accepted"]
            await wait_until(lambda: vstat()["accepted"] >= a0 + SAMPLES, timeout=300,
                             what="honest verdicts under attack")
            st = vstat()
            under = list(st["latency_s"][ids["worker"]])[-SAMPLES:]
            assert not net.failures(), net.failures()
            return baseline, under, st, flood.status(), tarpit.status(), dict(validator.swarm.banned)

    baseline, under, st, flood_stat, tarpit_stat, banned = asyncio.run(main())
    print(f"honest verdict latency (s): baseline {baseline}, under attack {under}")
    print(f"attackers sent {flood_stat['sent']} / {tarpit_stat['sent']}; "
          f"validator intake {st['intake']}, strikes {st['strikes_by_worker']}")
    assert len(under) >= SAMPLES
    assert statistics.median(under) <= statistics.median(baseline) + SLACK_MEDIAN_S, (baseline, under)
    assert max(under) <= max(baseline) + SLACK_MAX_S, (baseline, under)
    # The attacks were real and charged to the attackers, not to the honest worker.
    refused = st["intake"]["refused"]
    assert refused.get("future", 0) >= 1 and refused.get("flood", 0) + refused.get("busy", 0) >= 1, st
    assert st["unavailable"] >= 1 and tarpit_stat["tarpit_requests"] >= 1
    assert ids["worker"] not in st["strikes_by_worker"] and ids["worker"] not in st["rejections_by_worker"]
    assert ids["flood"] in banned, banned  # banned at the swarm: what it sends next is dropped
    assert st["strikes_by_worker"].get(ids["tarpit"], 0) >= 1, st
