"""/metrics is exported from the StatusBoard: served over real HTTP and parsed back with Prometheus'
parser."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from intellect_node.config.status import StatusBoard
from intellect_node.node.metrics import metrics_routes, status_routes


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def _scrape(board: StatusBoard, path: str = "/metrics") -> tuple[str, str]:
    app = web.Application()
    app.add_routes(metrics_routes(board) + status_routes(board))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
                return await resp.text(), f"{resp.status} {resp.headers['Content-Type']}"
    finally:
        await runner.cleanup()


def test_metrics_over_http_follow_the_board() -> None:
    b = StatusBoard(role="validator")
    b.set_identity("12D3KooWX", version="0.1.0")
    b.set_peers(4, trainers=["T"], validators=["V1", "V2"])
    b.set_policy(current=9, local=7)
    b.rollouts_generated(10, tokens=320)
    b.verdict(True, 6)
    b.verdict(False, 4, reason="toploc_mismatch")
    b.proof_checked(True)
    b.proof_checked(False, reason="toploc_mismatch")
    b.proof_checked(False, reason="toploc_mismatch")
    b.shard_done("c", new_bytes=4096)
    b.train_step(3, reward_mean=0.75, pass_rate=0.5)
    text, ctype = asyncio.run(_scrape(b))
    assert ctype.startswith("200 text/plain")
    m = _samples(text)
    assert m[("intellect_node_peers", (("role", "any"),))] == 4
    assert m[("intellect_node_peers", (("role", "validator"),))] == 2
    assert m[("intellect_node_policy_version", (("which", "current"),))] == 9
    assert m[("intellect_node_policy_staleness_steps", ())] == 2
    assert m[("intellect_node_rollouts_total", (("verdict", "accepted"),))] == 6
    assert m[("intellect_node_rollouts_total", (("verdict", "rejected"),))] == 4
    assert m[("intellect_node_proof_failures_total", (("reason", "toploc_mismatch"),))] == 2
    assert m[("intellect_node_shard_bytes_downloaded_total", ())] == 4096
    assert m[("intellect_node_tokens_generated_total", ())] == 320
    assert m[("intellect_node_pass_rate", ())] == 0.5
    assert m[("intellect_node_node_info", (("peer_id", "12D3KooWX"), ("role", "validator"), ("run_id", ""),
                                           ("state", "starting"), ("version", "0.1.0")))] == 1
    # a later scrape sees later counts (no cached registry state)
    b.verdict(True, 1)
    m2 = _samples(asyncio.run(_scrape(b))[0])
    assert m2[("intellect_node_rollouts_total", (("verdict", "accepted"),))] == 7


def test_health_metrics_and_health_endpoint() -> None:
    from tests.support.operator_node import FakeClock

    clock = FakeClock()
    b = StatusBoard(role="worker", clock=clock, monotonic=clock)
    b.set_state("running")
    b.refreshed()
    m = _samples(asyncio.run(_scrape(b))[0])
    assert m[("intellect_node_healthy", ())] == 1 and m[("intellect_node_status_age_seconds", ())] == 0
    assert m[("intellect_node_restarts_total", (("part", "libp2p"),))] == 0
    body, status = asyncio.run(_scrape(b, "/v1/health"))
    assert status.startswith("200") and '"healthy": true' in body

    b.set_degraded("libp2p", "libp2p restarting: the libp2p thread ended")
    b.set_restarts("libp2p", 2)
    b.warn("the libp2p thread ended: DecodeError: Error parsing message")
    clock.t += 9
    m = _samples(asyncio.run(_scrape(b))[0])
    assert m[("intellect_node_healthy", ())] == 0 and m[("intellect_node_status_age_seconds", ())] == 9
    assert m[("intellect_node_restarts_total", (("part", "libp2p"),))] == 2
    assert m[("intellect_node_warnings_recent", ())] == 1
    info = next(k for k in m if k[0] == "intellect_node_node_info")
    assert ("state", "degraded") in info[1]
    body, status = asyncio.run(_scrape(b, "/v1/health"))
    assert status.startswith("503") and "libp2p restarting" in body


def test_the_join_timeline_is_exported_once_each_stage_is_reached() -> None:
    from tests.support.operator_node import FakeClock

    clock = FakeClock()
    b = StatusBoard(role="worker", clock=clock, started_at=clock.t - 1.0)
    m = _samples(asyncio.run(_scrape(b))[0])
    assert not [k for k in m if k[0] == "intellect_node_timeline_seconds"]  # nothing reached: absent
    b.set_state("running")
    clock.t += 2.0
    b.set_peers(1, trainers=["T"])
    m = _samples(asyncio.run(_scrape(b))[0])
    stages = {dict(k[1])["stage"]: v for k, v in m.items() if k[0] == "intellect_node_timeline_seconds"}
    assert stages == {"ready": 1.0, "first_peer": 3.0}


def test_step_attempts_without_a_learnable_group_are_exported_by_cause() -> None:
    from intellect_node.config.status import NO_SIGNAL_ATTEMPTS

    b = StatusBoard(role="trainer")
    m = _samples(asyncio.run(_scrape(b))[0])
    assert m[("intellect_node_train_attempts_total", ())] == 0 and m[("intellect_node_not_learning", ())] == 0
    assert ("intellect_node_groups_filtered_fraction", ()) not in m  # no attempt yet
    b.train_attempt(groups=8, filtered=6)
    for _ in range(NO_SIGNAL_ATTEMPTS):
        b.train_attempt(groups=8, filtered=8, cause="all_zero", hint="every reward 0")
    m = _samples(asyncio.run(_scrape(b))[0])
    assert m[("intellect_node_train_attempts_total", ())] == NO_SIGNAL_ATTEMPTS + 1
    no_signal = "intellect_node_train_attempts_no_signal_total"
    assert m[(no_signal, (("cause", "all_zero"),))] == NO_SIGNAL_ATTEMPTS
    assert m[(no_signal, (("cause", "all_one"),))] == 0
    assert m[("intellect_node_no_signal_streak", ())] == NO_SIGNAL_ATTEMPTS
    assert m[("intellect_node_not_learning", ())] == 1
    assert m[("intellect_node_train_groups_total", (("outcome", "seen"),))] == 8 * (NO_SIGNAL_ATTEMPTS + 1)
    assert m[("intellect_node_train_groups_total", (("outcome", "filtered"),))] == 6 + 8 * NO_SIGNAL_ATTEMPTS
    assert m[("intellect_node_groups_filtered_fraction", ())] == 1.0


def test_gossip_not_delivered_is_exported_by_outcome() -> None:
    """Replays ignored (stale, repeats) apart from messages refused with blame."""
    board = StatusBoard(role="worker")
    board.set_gossip(refused=2, stale=100, repeat=3)
    text, _ = asyncio.run(_scrape(board))
    samples = _samples(text)
    name = "intellect_node_gossip_undelivered_total"
    assert {k[1][0][1]: v for k, v in samples.items() if k[0] == name} == \
        {"refused": 2, "ignored_stale": 100, "ignored_repeat": 3}
    peers = board.snapshot().to_dict()["peers"]
    assert isinstance(peers, dict) and peers["gossip_ignored_stale"] == 100


def test_the_last_step_sizes_are_exported_once_a_step_trained() -> None:
    from intellect_node.config.status import StepDiagnostics

    b = StatusBoard(role="trainer")
    m = _samples(asyncio.run(_scrape(b))[0])
    assert m[("intellect_node_step_too_large", ())] == 0 and ("intellect_node_step_kl_sampler", ()) not in m
    b.train_step(1, reward_mean=0.5, pass_rate=0.5, step_warning="too large",
                 diagnostics=StepDiagnostics(kl_sampler=0.2, clipped_frac=0.3, ratio_mean=1.1, ratio_max=2.5,
                                             grad_norm=0.7, lr=1e-5, entropy=1.5, staleness_max=2))
    m = _samples(asyncio.run(_scrape(b))[0])
    got = {k[0].removeprefix("intellect_node_"): v for k, v in m.items()
           if k[0].startswith("intellect_node_step_")}
    assert got == {"step_too_large": 1, "step_kl_sampler": 0.2, "step_clipped_fraction": 0.3,
                   "step_ratio_mean": 1.1, "step_ratio_max": 2.5, "step_grad_norm": 0.7, "step_lr": 1e-5,
                   "step_entropy": 1.5, "step_staleness_max": 2}


def test_the_newest_held_out_evaluation_is_exported_with_its_evaluator() -> None:
    from intellect_node.config.status import HeldOut

    b = StatusBoard(role="validator")
    m = _samples(asyncio.run(_scrape(b))[0])
    assert not any(k[0].startswith("intellect_node_held_out") for k in m)
    b.set_held_out(HeldOut(version=6, n=256, pass_rate=0.25, mean_reward=0.3, evaluator="12D3KooWE",
                           evaluators=2, confirmed=3, refused=1, at=1.0))
    m = _samples(asyncio.run(_scrape(b))[0])
    got = {(k[0].removeprefix("intellect_node_held_out_"), k[1]): v for k, v in m.items()
           if k[0].startswith("intellect_node_held_out_")}
    who = (("evaluator", "12D3KooWE"),)
    assert got == {("version", who): 6, ("problems", who): 256, ("pass_rate", who): 0.25,
                   ("mean_reward", who): 0.3, ("results_total", (("outcome", "confirmed"),)): 3,
                   ("results_total", (("outcome", "refused"),)): 1}
