"""A worker's pacing (``roles/worker/pacing.py``): credit back on evidence that the trainer wants more
work, never on a timer while the swarm is healthy; the stall fallback waits several version intervals."""

from __future__ import annotations

from intellect_node.protocol.steps import DroppedBatch, StepBatch, StepRecord, StepSettings
from intellect_node.roles.worker.pacing import STALL_FACTOR, STALL_FLOOR_S, Pacing

ME, OTHER = "12D3KooWme", "12D3KooWother"
SETTINGS = StepSettings(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0, group_size=2, clip_eps_low=0.2,
                        clip_eps_high=0.28, neg_ratio_cap=3.0, max_grad_norm=1.0, token_budget=1,
                        kl_coef=0.0, entropy_coef=0.0, scale_by_std=False, temperature=1.0, micro_tokens=None,
                        compute_dtype=None)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def record(batches: list[tuple[str, str]], *, trained: bool, seq: int = 1, version: int = 0,
           dropped: tuple[tuple[str, str], ...] = ()) -> StepRecord:
    return StepRecord(run_id="r", seq=seq, step=0, base_version=version, base_hash="h",
                      version=version + int(trained), checkpoint_hash="h", settings=SETTINGS,
                      batches=[StepBatch(cid=c, worker=w, groups=2, trained=[0] if trained else [])
                               for c, w in batches],
                      dropped=[DroppedBatch(cid=c, worker=w, reason="stale") for c, w in dropped],
                      no_signal="" if trained else "all_zero")


def spend(p: Pacing, *cids: str, version: int = 0) -> None:
    for c in cids:
        assert p.may_make()
        p.submitted(c, version)


def test_credit_starts_at_the_cap_and_each_version_adds_its_share() -> None:
    clock = Clock()
    p = Pacing(2, 1, async_level=2, clock=clock)
    p.on_version(0)
    spend(p, "a", "b", "c", "d")  # (1 + work_ahead) x batches_per_version
    assert not p.may_make()
    p.on_version(1)
    spend(p, "e", "f", version=1)
    assert not p.may_make()
    p.on_version(3)  # missed a version: its share counts too, up to the cap
    assert p.credit == 4


def test_a_step_that_trained_nothing_gives_its_batches_back_once() -> None:
    clock = Clock()
    p = Pacing(1, 0, async_level=2, clock=clock)
    p.on_version(0)
    spend(p, "a")
    assert not p.may_make()
    rec = record([("a", ME), ("x", OTHER)], trained=False)
    assert p.on_record(rec, ME) == 1 and p.may_make()
    assert p.on_record(rec, ME) == 0  # heard again (redelivered, a replayed journal step): nothing more
    spend(p, "b")
    # a step that trained: the new version gives the credit, not the record
    assert p.on_record(record([("b", ME)], trained=True, seq=2), ME) == 0 and not p.may_make()
    # another worker's batches give this worker nothing
    assert p.on_record(record([("y", OTHER)], trained=False, seq=3), ME) == 0
    assert p.status()["refilled_no_signal"] == 1


def test_only_a_refusal_that_was_not_the_workers_fault_gives_a_batch_back() -> None:
    p = Pacing(1, 1, async_level=2, clock=Clock())
    p.on_version(0)
    spend(p, "a", "b")
    assert p.on_refusal("a", "bad_proof") == 0 and not p.may_make()  # its own fault: no faster retries
    assert p.on_refusal("b", "stale") == 0  # the version that made it stale gave the credit already
    spend_p = Pacing(1, 0, async_level=2, clock=Clock())
    spend_p.on_version(0)
    spend(spend_p, "c")
    assert spend_p.on_refusal("c", "reward_unjudged") == 1 and spend_p.may_make()
    assert spend_p.on_refusal("c", "reward_unjudged") == 0  # once per batch
    assert spend_p.on_refusal("unknown", "policy_version") == 0  # not a batch it made


def test_no_timer_paces_a_healthy_run_and_a_stall_waits_several_version_intervals() -> None:
    clock = Clock()
    p = Pacing(1, 0, async_level=2, clock=clock)
    for v in range(4):  # versions 100 s apart: the stall fallback waits 3 of them
        p.on_version(v)
        spend(p, f"b{v}", version=v)
        clock.t += 100.0
    assert p.stall_after_s == STALL_FACTOR * 100.0
    assert not p.may_make()  # 100 s after the last batch: well inside a healthy step's time
    clock.t += STALL_FACTOR * 100.0 - 100.0 - 1.0
    assert not p.may_make()
    clock.t += 2.0
    assert p.may_make() and p.status()["stall_batches"] == 1  # one batch, counted
    p.submitted("s", 3)
    assert not p.may_make()
    fresh = Pacing(1, 0, async_level=2, clock=Clock())
    assert fresh.stall_after_s == STALL_FLOOR_S  # no interval heard yet: the floor


def test_batches_too_old_to_be_trained_are_forgotten() -> None:
    p = Pacing(1, 2, async_level=1, clock=Clock())
    p.on_version(0)
    spend(p, "a")
    p.on_version(1)
    spend(p, "b", version=1)
    p.on_version(2)  # "a" (v0) is now stale at the trainer: nothing will resolve it
    assert p.status()["pending"] == 1
    assert p.on_record(record([("a", ME)], trained=False, version=2), ME) == 0
