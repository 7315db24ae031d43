"""Helpers for the operator tests (status, dashboard, metrics, demo)."""

from __future__ import annotations

from intellect_node.config.status import StatusBoard


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def busy_board(clock: FakeClock) -> StatusBoard:
    b = StatusBoard(role="worker", clock=clock, monotonic=clock)
    b.set_identity("12D3KooWExample", version="0.1.0", listen_addrs=["/ip4/127.0.0.1/tcp/4001"])
    b.set_run("demo-run", model="arith-1m", dtype="float32", trainer_peer_id="12D3KooWTrainer", async_level=2)
    b.set_peers(3, trainers=["T"], validators=["V"], workers=["W2"])
    b.set_reachability("public", public_addrs=["/ip4/127.0.0.1/tcp/4001"])
    b.set_policy(current=5, local=3)
    b.shard_progress("bafyA", "policy-5/shard-0", 100, 400, new_bytes=100)
    b.rollouts_generated(16, tokens=600)
    clock.t += 10
    b.rollouts_generated(16, tokens=600)
    b.rollouts_submitted(32)
    b.verdict(True, 16)
    b.verdict(False, 16, reason="toploc_mismatch", detail="exp mismatches 41 > 10", peer="V")
    b.proof_checked(True)
    b.proof_checked(False, reason="logprob")
    b.train_step(1, reward_mean=0.25, pass_rate=0.5)
    b.warn("bootstrap peer down")
    return b
