"""Policy announcements: only the run's trainer, only this run, only consistent chains; hostile bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_node.errors import ProtocolError
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.policy import (
    MAX_CHAIN,
    POLICY_DOMAIN,
    DeltaLink,
    PolicyAnnouncement,
    announcement_validator,
    check_announcement,
    open_announcement,
    seal_announcement,
)
from intellect_node.protocol.signing import Envelope, SigningKey

RUN = "run-a"


def _h(v: int) -> str:
    return cid_of(f"checkpoint {v}".encode())


def _ann(version: int, full_version: int, first_link: int | None = None, **kw: Any) -> PolicyAnnouncement:
    first = full_version + 1 if first_link is None else first_link
    links = [DeltaLink(version=v, base_hash=_h(v - 1), target_hash=_h(v), delta_cid=cid_of(b"d%d" % v),
                       delta_size=1000 + v) for v in range(max(first, 1), version + 1)]
    fields: dict[str, Any] = dict(run_id=RUN, version=version, dtype="BF16", checkpoint_hash=_h(version),
                                     checkpoint_size=10_000, full_version=full_version,
                                     full_cid=cid_of(b"full %d" % full_version), full_size=10_000,
                                     deltas=links)
    fields.update(kw)
    return PolicyAnnouncement(**fields)


def test_trainer_announcement_opens_and_names_the_chain() -> None:
    trainer = SigningKey.generate()
    ann = _ann(7, 4)
    got = open_announcement(seal_announcement(trainer, ann), run_id=RUN, trainer=trainer.peer_id)
    assert got == ann
    assert got.full_hash == _h(4) and got.link(5).base_hash == _h(4) and got.link(7).target_hash == _h(7)
    with pytest.raises(KeyError):
        got.link(4)
    full = _ann(8, 8, first_link=8)  # a full version still carries the delta from its predecessor
    assert check_announcement(full).full_hash == _h(8) and full.link(8).base_hash == _h(7)
    assert check_announcement(_ann(0, 0)).deltas == []


def test_mallory_and_other_runs_are_refused() -> None:
    trainer, mallory = SigningKey.generate(), SigningKey.generate()
    validate = announcement_validator(RUN, trainer.peer_id)
    assert validate(seal_announcement(trainer, _ann(3, 0)), mallory.peer_id).version == 3  # relayed is fine
    with pytest.raises(ProtocolError, match="not the run's trainer"):
        validate(seal_announcement(mallory, _ann(3, 0)), mallory.peer_id)
    with pytest.raises(ProtocolError, match="run"):
        validate(seal_announcement(trainer, _ann(3, 0, run_id="run-b")), trainer.peer_id)
    # The trainer's signature over another kind of message does not make an announcement.
    with pytest.raises(ProtocolError, match="expected"):
        validate(trainer.seal("intellect/heartbeat/1", _ann(3, 0)), trainer.peer_id)
    # A re-signed payload under the trainer's name fails the signature check.
    env = codec.decode(seal_announcement(trainer, _ann(3, 0)), Envelope, max_size=1 << 20)
    forged = codec.encode(msgspec.structs.replace(env, payload=codec.encode(_ann(4, 0)),
                                                  signature=mallory.sign_bytes(POLICY_DOMAIN,
                                                                               codec.encode(_ann(4, 0)))))
    with pytest.raises(ProtocolError, match="signature"):
        validate(forged, trainer.peer_id)


@pytest.mark.parametrize("bad", [
    lambda: _ann(5, 2, first_link=4),  # chain does not reach back to the full version
    lambda: _ann(5, 6),  # full version after the announced one
    lambda: _ann(5, 2, checkpoint_hash=_h(99)),  # chain ends elsewhere
    lambda: _ann(5, 2, dtype="F8"),
    lambda: _ann(5, 2, run_id=""),
    lambda: _ann(5, 2, full_cid="Qm123"),
    lambda: _ann(5, 2, checkpoint_size=0),
    lambda: msgspec.structs.replace(_ann(0, 0), version=-1, full_version=-1),
    lambda: _ann(MAX_CHAIN + 2, 0),  # longer chain than allowed
    lambda: _ann(5, 2, deltas=[DeltaLink(version=4, base_hash=_h(3), target_hash=_h(4), delta_cid=_h(0),
                                         delta_size=1),
                               DeltaLink(version=5, base_hash=_h(3), target_hash=_h(5), delta_cid=_h(0),
                                         delta_size=1)]),  # links do not join
    lambda: _ann(5, 4, deltas=[DeltaLink(version=6, base_hash=_h(4), target_hash=_h(5), delta_cid=_h(0),
                                         delta_size=1)]),  # link numbers do not end at the version
])
def test_inconsistent_announcements_refused(bad: Callable[[], PolicyAnnouncement]) -> None:
    trainer = SigningKey.generate()
    ann = bad()
    with pytest.raises(ProtocolError):
        check_announcement(ann)
    with pytest.raises(ProtocolError):  # and the trainer's own node refuses to send it
        seal_announcement(trainer, ann)
    raw = trainer.seal(POLICY_DOMAIN, ann)  # a buggy or hostile trainer sends it anyway
    with pytest.raises(ProtocolError):
        open_announcement(raw, run_id=RUN, trainer=trainer.peer_id)


@given(st.binary(max_size=600))
@settings(max_examples=300)
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        open_announcement(data, run_id=RUN, trainer=SigningKey(bytes(32)).peer_id)
    except ProtocolError:
        pass
