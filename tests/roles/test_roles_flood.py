"""A validator cannot be stalled by cheap notices (issue #12, part 4), with real processes on loopback.

A trainer, a validator and an honest worker run until the validator has issued a few verdicts on the
honest worker's batches (the unloaded baseline, measured here, on this machine, now). Then two hostile
peers join (``tests/support/hostile.py``): one floods well-formed signed notices (8 a second, for blobs
it tarpits, for versions far in the future and for the next version), the other sends a notice for a
tarpitted blob every 2.5 s. The honest worker's next verdicts must come within a few seconds of the
baseline; the attackers' unbacked notices are charged to them (``future``, ``unavailable``; the excess
refused as ``busy``/``flood`` is recorded, not a strike) and the flooder is banned.

Before the intake (one loop, one notice at a time) each tarpitted blob held every verdict up for its 60 s
fetch timeout and each next-version notice for 30 s.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.support.roles import role_run
from tests.support.wait import wait_for

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


def test_flooding_and_tarpitting_peers_barely_delay_honest_verdicts(tmp_path: Path) -> None:
    with role_run(tmp_path, ("trainer", "validator", "worker", "flood", "tarpit"), rl=RL,
                  validator=VALIDATOR) as run:
        ids = run.ids
        _, t_addr, validator, v_addr = run.trainer_and_validator()

        def vstat() -> dict[str, Any]:
            status: dict[str, Any] = validator.status()["validator"]
            return status

        def honest() -> list[float]:
            return list(vstat()["latency_s"].get(ids["worker"], []))

        run.start("worker", "worker", bootstrap=[t_addr, v_addr])
        # The baseline skips the first verdict (it waited for the validator's first policy).
        wait_for(lambda: len(honest()) >= SAMPLES + 1, timeout=300, what="baseline verdicts")
        baseline = honest()[1:SAMPLES + 1]

        flood = run.hostile("flood", "flood", bootstrap=[t_addr, v_addr])
        tarpit = run.hostile("tarpit", "tarpit", bootstrap=[t_addr, v_addr])

        def attacked() -> bool:
            strikes = vstat()["strikes_by_worker"]
            return bool(strikes.get(ids["flood"], 0) >= 1 and vstat()["unavailable"] >= 1)
        wait_for(attacked, timeout=120, what="both attacks under way (a flood refused, a tarpit timed out)")
        # The status keeps only a worker's 32 latest latencies (on a loaded machine the honest worker can
        # pass that before the attacks are seen), so count verdicts by the validator's total; only the
        # honest worker's batches can be accepted, and its latest latencies all come from under attack.
        a0 = vstat()["accepted"]
        wait_for(lambda: vstat()["accepted"] >= a0 + SAMPLES, timeout=300,
                 what="honest verdicts under attack")
        st = vstat()
        under = list(st["latency_s"][ids["worker"]])[-SAMPLES:]
        tarpit_stat = tarpit.status()
        flood_stat = flood.status()
        book = {r["peer_id"]: r for r in validator.status()["known_peers"]}

    print(f"honest verdict latency (s): baseline {baseline}, under attack {under}")
    print(f"attackers sent {flood_stat['attacker']['sent']} / {tarpit_stat['attacker']['sent']}; "
          f"validator intake {st['intake']}, strikes {st['strikes_by_worker']}")
    assert len(under) >= SAMPLES
    assert statistics.median(under) <= statistics.median(baseline) + SLACK_MEDIAN_S, (baseline, under)
    assert max(under) <= max(baseline) + SLACK_MAX_S, (baseline, under)
    # The attacks were real and charged to the attackers, not to the honest worker.
    refused = st["intake"]["refused"]
    assert refused.get("future", 0) >= 1 and refused.get("flood", 0) + refused.get("busy", 0) >= 1, st
    assert st["unavailable"] >= 1 and tarpit_stat["attacker"]["tarpit_requests"] >= 1
    assert ids["worker"] not in st["strikes_by_worker"] and ids["worker"] not in st["rejections_by_worker"]
    assert book[ids["flood"]]["banned"], book[ids["flood"]]
    assert st["strikes_by_worker"].get(ids["tarpit"], 0) >= 1, st

