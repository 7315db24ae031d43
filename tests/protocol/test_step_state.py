"""A step record's checkpoint state (``StepState``): round trip under the trainer's signature, tampering
refused, and only a step that trained may carry one."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from intellect_node.errors import ProtocolError
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.steps import (
    StepBatch,
    StepRecord,
    StepSettings,
    StepState,
    open_record,
    seal_record,
)

TRAINER = SigningKey(bytes(range(32)))
MALLORY = SigningKey(bytes(range(1, 33)))
H0, H1 = cid_of(b"v0"), cid_of(b"v1")
STATE = StepState(weights_cid=cid_of(b"w"), optimizer_cid=cid_of(b"o"), optimizer_hash=cid_of(b"oh"))
SETTINGS = StepSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, group_size=4, clip_eps_low=0.2,
                        clip_eps_high=0.2, neg_ratio_cap=4.0, max_grad_norm=0.1, token_budget=64, kl_coef=0.0,
                        entropy_coef=0.0, scale_by_std=False, temperature=1.0, micro_tokens=None,
                        compute_dtype=None)


def _record(**kw: Any) -> StepRecord:
    base: dict[str, Any]
    base = dict(run_id="r1", seq=3, step=2, base_version=1, base_hash=H0, version=2, checkpoint_hash=H1,
                batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2, trained=[0])], settings=SETTINGS,
                state=STATE)
    base.update(kw)
    return StepRecord(**base)


def test_state_round_trips_under_the_trainers_signature() -> None:
    rec = _record()
    assert open_record(seal_record(TRAINER, rec), run_id="r1", trainer=TRAINER.peer_id).state == STATE
    with pytest.raises(ProtocolError):
        open_record(seal_record(MALLORY, rec), run_id="r1", trainer=TRAINER.peer_id)


def test_state_cannot_be_swapped_in_transit() -> None:
    raw = bytearray(seal_record(TRAINER, _record()))
    i = raw.find(STATE.optimizer_hash.encode())
    raw[i + 10] ^= 1
    with pytest.raises(ProtocolError):
        open_record(bytes(raw), run_id="r1", trainer=TRAINER.peer_id)


@pytest.mark.parametrize("kw, match", [
    (dict(version=1, checkpoint_hash=H0, no_signal="all_zero",
          batches=[StepBatch(cid=cid_of(b"b1"), worker="w1", groups=2)]), "only a step that trained"),
    (dict(state=msgspec.structs.replace(STATE, optimizer_cid="not-a-cid")), "CID"),
])
def test_inconsistent_state_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        seal_record(TRAINER, _record(**kw))
