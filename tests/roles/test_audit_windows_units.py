"""Audit windows on the CPU, in process: the optimizer state's file, a replay from a mid-run checkpoint,
and the window choice.

- the optimizer state's canonical file round-trips bit for bit (same bytes from the same state, every
  moment equal after loading, and the next step identical), and a file that is not one (a stray name, a
  shape or dtype that does not fit, a parameter with part of its entries, random bytes) raises only
  ``ProtocolError``;
- a "trainer" takes steps and checkpoints mid-run, publishing the weights and optimizer state: a replay
  of the window from that checkpoint, on another copy of the model loaded from the published bytes,
  makes every later step's published hash bit for bit and the end checkpoint's optimizer hash; the
  same window from a fresh optimizer does not (the state is what makes it replayable), a nudged step
  fails, and a published optimizer state other than the one the steps made fails at the window's end;
- :class:`WindowPlan` draws each start once, goes on at fraction 1.0, and starts a late joiner at the
  first checkpoint it hears.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.steps import StepBatch, StepRecord, StepSettings, StepState, check_record
from intellect_node.roles.auditor.replay import StepAudit, WindowReplay, weights_hash
from intellect_node.roles.auditor.windows import WindowPlan, check_end, load_start
from intellect_node.roles.common.grpo import grpo_config_of, settings_of
from intellect_node.roles.common.pins import TRAINER_STATES, published_pins
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.optstate import decode_optimizer, encode_optimizer, load_optimizer
from intellect_node.trainer.step import Sample, make_optimizer, train_step
from tests.support.grpo import scored_samples, tiny_llama

torch.set_num_threads(1)  # as the trainer and the auditor run: bitwise replays need it

GROUP = 4
SETTINGS = settings_of(GRPOConfig(group_size=GROUP, token_budget=64, max_grad_norm=1.0), lr=1e-2,
                       temperature=1.0, micro_tokens=None, compute_dtype=None)
RUN = "units"


@functools.cache
def _sampler() -> Any:
    return tiny_llama(seed=100)


def _step(model: Any, opt: Any, samples: list[Sample], s: StepSettings = SETTINGS) -> None:
    train_step(model, opt, samples, grpo_config_of(s), temperature=s.temperature,
               micro_tokens=s.micro_tokens, compute_dtype=None)


@functools.cache
def _groups(seed: int) -> list[list[Sample]]:
    """Two groups with unequal rewards (both train), sampled from a model of their own."""
    samples = scored_samples(_sampler(), [[1, 3, 5], [1, 4]], GROUP, seed=seed)
    groups = [samples[i:i + GROUP] for i in range(0, len(samples), GROUP)]
    assert all(len({s.reward for s in g}) > 1 for g in groups)
    return groups


def test_optimizer_state_round_trips_bit_for_bit() -> None:
    model = tiny_llama(seed=1)
    opt = make_optimizer(model, SETTINGS.lr)
    for i in range(2):
        _step(model, opt, [s for g in _groups(i) for s in g])
    blob = encode_optimizer(opt)
    assert encode_optimizer(opt).content_hash == blob.content_hash  # one encoding for one state
    parsed = PolicyWeights.parse(bytes(blob.to_bytes()), max_size=1 << 30)
    twin = tiny_llama(seed=2)
    twin.load_state_dict(model.state_dict())
    opt2 = make_optimizer(twin, SETTINGS.lr)
    load_optimizer(opt2, parsed)
    assert encode_optimizer(opt2).content_hash == blob.content_hash
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    more = [s for g in _groups(7) for s in g]
    _step(model, opt, more)
    _step(twin, opt2, more)
    assert weights_hash(model) == weights_hash(twin)


def _mutated(blob: PolicyWeights, edit: Any) -> PolicyWeights:
    tensors = dict(blob.to_state_dict())
    edit(tensors)
    return PolicyWeights.from_state_dict(tensors)


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.__setitem__("000000.momentum", torch.zeros(1)), "is not <index>"),
    (lambda t: t.__setitem__("000999.step", torch.tensor(1.0)), "names parameter 999"),
    (lambda t: t.pop("000000.exp_avg_sq"), "holds"),
    (lambda t: t.__setitem__("000000.exp_avg", torch.zeros(3)), "shape"),
    (lambda t: t.__setitem__("000000.step", torch.tensor(1, dtype=torch.int64)), "must be"),
    (lambda t: t.__setitem__("000000.exp_avg", t["000000.exp_avg"].double()), "must be"),
])
def test_optimizer_state_that_does_not_fit_is_refused(edit: Any, why: str) -> None:
    model = tiny_llama(seed=1)
    opt = make_optimizer(model, SETTINGS.lr)
    _step(model, opt, [s for g in _groups(0) for s in g])
    bad = _mutated(encode_optimizer(opt), edit)
    with pytest.raises(ProtocolError, match=why):
        load_optimizer(make_optimizer(model, SETTINGS.lr), bad)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_no_optimizer_state(data: bytes) -> None:
    params = [torch.zeros(2)]
    try:
        decode_optimizer(PolicyWeights.parse(data, max_size=1 << 20), params)
    except ProtocolError:
        pass


def _record(seq: int, base: str, new: str, groups: list[list[Sample]], version: int,
            state: StepState | None = None) -> StepRecord:
    batch = StepBatch(cid=cid_of(f"batch-{seq}".encode()), worker="12D3KooWworker", groups=len(groups),
                      trained=list(range(len(groups))))
    return check_record(StepRecord(run_id=RUN, seq=seq, step=version, base_version=version - 1,
                                   base_hash=base, version=version, checkpoint_hash=new, batches=[batch],
                                   settings=SETTINGS, state=state))


class Trainer:
    """Steps as the trainer role takes them, each with its record; ``checkpoint()`` publishes the state
    after the last one (what ``roles/trainer/records.py`` puts in the blob store)."""

    def __init__(self) -> None:
        self.model = tiny_llama(seed=5)
        self.opt = make_optimizer(self.model, SETTINGS.lr)
        self.records: list[StepRecord] = []
        self.batches: dict[str, list[list[Sample]]] = {}
        self.blobs: dict[int, tuple[PolicyWeights, PolicyWeights]] = {}

    def step(self, *, nudge: bool = False) -> None:
        groups = _groups(len(self.records))
        base = weights_hash(self.model)
        _step(self.model, self.opt, [s for g in groups for s in g])
        if nudge:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1e-4)
        rec = _record(len(self.records) + 1, base, weights_hash(self.model), groups, len(self.records) + 1)
        self.records.append(rec)
        self.batches[rec.batches[0].cid] = groups

    def checkpoint(self, optimizer: PolicyWeights | None = None) -> None:
        weights = PolicyWeights.from_state_dict(self.model.state_dict())
        optimizer = optimizer or encode_optimizer(self.opt)
        rec = self.records[-1]
        state = StepState(weights_cid=cid_of(b"w%d" % rec.seq), optimizer_cid=cid_of(b"o%d" % rec.seq),
                          optimizer_hash=optimizer.content_hash)
        self.records[-1] = msgspec.structs.replace(rec, state=state)
        self.blobs[rec.seq] = (weights, optimizer)

    def groups_of(self, b: StepBatch) -> list[list[Sample]] | None:
        return self.batches.get(b.cid)


def _replay_from(t: Trainer, seq: int, *, fresh_optimizer: bool = False) -> list[StepAudit]:
    """The window after record ``seq`` replayed on another copy of the model, from the published bytes."""
    start = t.records[seq - 1]
    weights, optimizer = (PolicyWeights.parse(bytes(b.to_bytes()), max_size=1 << 30) for b in t.blobs[seq])
    replay = load_start(tiny_llama(seed=9), start, weights, optimizer, SETTINGS)
    if fresh_optimizer:
        replay = WindowReplay(replay.model, SETTINGS)
    out = []
    for rec in t.records[seq:]:
        out.append(check_end(replay, rec, replay.audit(rec, t.groups_of)))
        if rec.state is not None:
            break
    return out


@pytest.fixture(scope="module")
def honest() -> Iterator[Trainer]:
    t = Trainer()
    for i in range(5):
        t.step()
        if i in (1, 4):  # checkpoints at v2 and v5
            t.checkpoint()
    yield t


def test_window_from_a_mid_run_checkpoint_replays_bit_for_bit(honest: Trainer) -> None:
    results = _replay_from(honest, 2)
    assert [r.outcome for r in results] == ["pass"] * 3, results
    assert [r.expected for r in results] == [r.checkpoint_hash for r in honest.records[2:]]


def test_the_published_optimizer_state_is_what_makes_the_window_replayable(honest: Trainer) -> None:
    results = _replay_from(honest, 2, fresh_optimizer=True)
    assert results[0].outcome == "fail" and "replayed weights differ" in results[0].reason


def test_start_blobs_are_checked_against_the_record(honest: Trainer) -> None:
    start = honest.records[1]
    weights, optimizer = honest.blobs[2]
    with pytest.raises(ProtocolError, match="optimizer blob"):
        load_start(tiny_llama(seed=9), start, weights, weights, SETTINGS)
    with pytest.raises(ProtocolError, match="weights blob"):
        load_start(tiny_llama(seed=9), start, optimizer, optimizer, SETTINGS)


def test_a_nudged_step_in_the_window_fails() -> None:
    t = Trainer()
    t.step()
    t.checkpoint()
    t.step(nudge=True)
    results = _replay_from(t, 1)
    assert results[0].outcome == "fail" and results[0].expected != results[0].published


def test_a_published_optimizer_state_the_steps_did_not_make_fails_at_the_window_end() -> None:
    t = Trainer()
    t.step()
    t.checkpoint()
    t.step()
    honest_state = encode_optimizer(t.opt)
    forged = _mutated(honest_state, lambda ts: ts.__setitem__("000000.exp_avg", ts["000000.exp_avg"] * 2))
    t.checkpoint(forged)
    results = _replay_from(t, 1)
    assert len(results) == 1 and results[0].outcome == "fail", results
    assert results[0].published == forged.content_hash and results[0].expected == honest_state.content_hash
    assert "optimizer state" in results[0].reason


def _held(seqs: dict[int, bool]) -> dict[int, StepRecord]:
    """Records by seq; True: it carries state (a checkpoint follows it)."""
    h = cid_of(b"h")
    groups = [[Sample((1,), (2,), (-1.0,), float(i % 2)) for i in range(GROUP)]]
    state = StepState(weights_cid=h, optimizer_cid=h, optimizer_hash=h)
    return {s: _record(s, h, h, groups, s, state if st else None) for s, st in seqs.items()}


def test_plan_at_fraction_one_starts_at_zero_and_goes_on() -> None:
    plan = WindowPlan(1.0, lambda: 0.999999)
    held = _held({1: False, 2: True, 3: False})
    start = plan.next_start(held)
    assert start is not None and start.first == 1 and start.record is None
    assert plan.goes_on(held[2]) and plan.skipped == 0


def test_plan_draws_each_start_once() -> None:
    draws = iter([0.9, 0.2, 0.9, 0.1])  # v0 no; after 2 yes; the end at 4 no; after 6 yes
    plan = WindowPlan(0.5, lambda: next(draws))
    held = _held({1: False, 2: True, 3: False, 4: True, 5: False, 6: True})
    start = plan.next_start(held)
    assert start is not None and start.first == 3 and start.record is held[2]
    assert not plan.goes_on(held[4])
    plan.prune(held)
    assert min(held) == 5
    start = plan.next_start(held)
    assert start is not None and start.first == 7 and start.record is held[6]
    assert plan.skipped == 2


def test_plan_starts_a_late_joiner_at_the_first_checkpoint_heard() -> None:
    plan = WindowPlan(1.0, lambda: 0.0)
    held = _held({7: False, 8: False})
    assert plan.next_start(held) is None
    held.update(_held({9: True, 10: False}))
    start = plan.next_start(held)
    assert start is not None and start.first == 10 and start.version == 9


def test_plan_refuses_a_fraction_out_of_range() -> None:
    with pytest.raises(ValueError):
        WindowPlan(0.0, lambda: 0.0)


def test_published_states_are_pinned(tmp_path: Path) -> None:
    a, b = cid_of(b"a"), cid_of(b"b")
    (tmp_path / TRAINER_STATES).parent.mkdir(parents=True)
    (tmp_path / TRAINER_STATES).write_text(json.dumps([{"version": 4, "seq": 5, "weights_cid": a,
                                                        "optimizer_cid": b}]))
    pins = published_pins(tmp_path)
    assert set(pins) == {a, b} and "v4" in pins[a]


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_audit_fraction_out_of_range_names_the_field(fraction: float) -> None:
    from intellect_node.config.loader import build_config
    from intellect_node.errors import ConfigError

    with pytest.raises(ConfigError, match="validator.audit_fraction") as info:
        build_config(validator={"audit": True, "audit_fraction": fraction})
    assert info.value.field == "validator.audit_fraction"
