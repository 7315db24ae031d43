"""Replayed gossip bans its real signer no more.

Anyone can keep a signed message and publish it again later (or get the signer's own libp2p message
forwarded again once the gossip seen-cache forgot it). Before, a message found stale was a
``ProtocolError`` recorded against its origin, the signer: a peer that collected 100 of the trainer's
heartbeats and replayed them once they were older than 5 minutes had every node ban the trainer for 7
days, and 110 copies of one auditor verdict had the run's only validator banned ("contradicts the pass
this auditor signed"). Now:

1. a dated message outside its window (heartbeats, run listings, sweep messages, audit verdicts) or a
   repeat of one already taken is ``MessageIgnored``: not delivered, not forwarded, blamed on no one;
2. audit verdicts are dated, checked for freshness, deduplicated by their signed content and must be
   published by their signer; a contradiction takes two different signed verdicts (pass and fail);
3. the peers the run names for a role (trainer, validators, auditors) are never banned automatically by
   rejection counts: the run's own rules (audits, quorum) deal with them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from libp2p.peer.id import ID

from intellect_node.config import build_config
from intellect_node.config.status import StatusBoard
from intellect_node.errors import MessageIgnored, ProtocolError
from intellect_node.p2p.heartbeat import Heartbeats
from intellect_node.p2p.peerbook import AUTO_BAN_AFTER, PeerBook
from intellect_node.protocol import gossip
from intellect_node.protocol import sweep as wire
from intellect_node.protocol.audits import AUDIT_KIND, AuditVerdict, seal_verdict
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rl import now_ms
from intellect_node.protocol.run_manifest import MAX_LISTING_AGE_MS, RunListing, open_listing, seal_listing
from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.topics import topic
from intellect_node.roles.common.audits import AuditWatch
from tests.support.swarm import run, swarm_nodes
from tests.support.wait import wait_until

RUN = "replays"
TRAINER, AUDITOR, MALLORY = (SigningKey(bytes([i]) * 32) for i in (21, 22, 23))
H1, H2 = cid_of(b"published"), cid_of(b"replayed")
OLD = 6 * 60 * 1000
"""A replay sealed six minutes ago: outside every five-minute window."""


def _heartbeat(key: SigningKey, *, seq: int, time_ms: int) -> bytes:
    hb = gossip.Heartbeat(run_id=RUN, seq=seq, time_ms=time_ms, http_url="http://127.0.0.1:1",
                          listen_addrs=[], roles=["trainer"])
    return key.seal(gossip.HEARTBEAT_DOMAIN, hb)


# -- 1. stale dated messages are ignored, not refused -----------------------------------------------

def test_stale_dated_messages_are_ignored_not_refused() -> None:
    now = now_ms()
    for stamp in (now - OLD, now + OLD):  # a replay, or a clock far ahead
        with pytest.raises(MessageIgnored):
            gossip.open_heartbeat(_heartbeat(TRAINER, seq=1, time_ms=stamp), run_id=RUN, now_ms=now)
        far = now + (MAX_LISTING_AGE_MS + 60_000) * (1 if stamp > now else -1)  # listings: 10 minutes
        listing = RunListing(node=TRAINER.peer_id, time_ms=far, runs=[])
        with pytest.raises(MessageIgnored):
            open_listing(seal_listing(TRAINER, listing), now_ms=now)
        claim = wire.Claim(run_id=RUN, sweep_id="s1", time_ms=stamp, coordinator=TRAINER.peer_id,
                           job_ids=[], capacity=1)
        with pytest.raises(MessageIgnored):
            wire.open_message(wire.seal(TRAINER, claim), run_id=RUN, now_ms=now)
    # What is wrong, not merely old, is still refused with blame.
    with pytest.raises(ProtocolError) as exc:
        gossip.open_heartbeat(_heartbeat(TRAINER, seq=1, time_ms=now), run_id="other", now_ms=now)
    assert not isinstance(exc.value, MessageIgnored)


def test_a_repeated_or_older_heartbeat_is_ignored_and_a_restart_is_not() -> None:
    swarm = SimpleNamespace(run_id=RUN, roles=[], peerbook=None)
    beats = Heartbeats(swarm, interval=5.0, peer_timeout=20.0)  # type: ignore[arg-type]  # what it reads
    now = now_ms()
    first = _heartbeat(TRAINER, seq=7, time_ms=now - 10_000)
    assert beats._validate(first, TRAINER.peer_id).seq == 7
    with pytest.raises(MessageIgnored, match="repeat"):
        beats._validate(first, TRAINER.peer_id)  # the same heartbeat again, still fresh
    with pytest.raises(MessageIgnored, match="repeat"):
        beats._validate(_heartbeat(TRAINER, seq=6, time_ms=now - 20_000), TRAINER.peer_id)  # an older one
    assert beats._validate(_heartbeat(TRAINER, seq=8, time_ms=now - 5_000), TRAINER.peer_id).seq == 8
    # A restarted node counts from 1 again, later; a clock stepped back still counts up: both taken.
    assert beats._validate(_heartbeat(TRAINER, seq=1, time_ms=now), TRAINER.peer_id).seq == 1
    assert beats._validate(_heartbeat(TRAINER, seq=2, time_ms=now - 1_000), TRAINER.peer_id).seq == 2
    assert beats.ignored == {"stale": 0, "repeat": 2}


def test_replayed_stale_heartbeats_do_not_get_the_trainer_banned() -> None:
    """The issue's attack over real libp2p: trainer - replayer - victim. The replayer forwards what it
    is given without looking (its validator accepts everything); what it forwards are 100 heartbeats the
    trainer signed more than 5 minutes ago (sealed here with an old stamp: a replay is those bytes)."""

    async def main() -> None:
        async with swarm_nodes(3, {0: [1], 1: [2]}, run_id=RUN) as nodes:
            trainer, replayer, victim = nodes
            name = topic(RUN, "heartbeat")
            for n in (trainer, replayer):
                n.subscribe(name, lambda data, origin: data, lambda msg, origin: None)
            beats = Heartbeats(victim, interval=600.0, peer_timeout=1200.0)
            beats.start()
            try:
                await wait_until(lambda: victim.peer_id in replayer.mesh_peers(name)
                                 and trainer.peer_id in replayer.mesh_peers(name), 30, what="meshes")
                old = now_ms() - OLD
                for i in range(AUTO_BAN_AFTER):
                    await trainer.publish(name, _heartbeat(trainer.key, seq=i + 1, time_ms=old + i))
                await trainer.publish(name, _heartbeat(trainer.key, seq=1000, time_ms=now_ms()))
                # One path, in order: once the fresh heartbeat is in, every replay before it was judged.
                await wait_until(lambda: victim.peerbook.state(trainer.peer_id) == "alive", 60,
                                 what="the trainer's fresh heartbeat at the victim")
                assert victim.ignored[name] == AUTO_BAN_AFTER and victim.dropped[name] == 0
                assert beats.ignored["stale"] == AUTO_BAN_AFTER
                assert not victim.is_banned(trainer.peer_id)
                assert victim.peerbook.rejections(trainer.peer_id)[0] == 0  # the signer: not blamed
                assert victim.peerbook.rejections(replayer.peer_id)[0] == 0
                scorer = victim.p2p.gossipsub.scorer  # nor the forwarder's gossip score (P4)
                assert scorer.invalid_messages[ID.from_base58(replayer.peer_id)][name] == 0
                assert victim.ignored_why == {"stale": AUTO_BAN_AFTER}
            finally:
                await beats.stop()

    run(main(), 180)


# -- 2. audit verdicts: dated, fresh, deduplicated, published by their signer -----------------------

def _verdict(seq: int, outcome: str, **kw: Any) -> AuditVerdict:
    expected = {"pass": H1, "fail": H2, "unavailable": ""}[outcome]
    return AuditVerdict(run_id=RUN, trainer=TRAINER.peer_id, seq=seq, version=seq,
                        outcome=outcome, published=H1, expected=expected, **kw)  # type: ignore[arg-type]  # keyword arguments from a table


class _Runtime:
    """What the audit watch uses of a node, with the real peerbook a node builds from its config."""

    def __init__(self, data_dir: Path) -> None:
        self.config = build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                                        "validator_peer_ids": [AUDITOR.peer_id], "require_audits": True})
        self.board = StatusBoard(role="worker")
        self.data_dir = data_dir
        book = PeerBook("12D3KooWself", run_peers=self.config.run.role_peers)
        self.swarm = SimpleNamespace(peerbook=book, subscribe=self._subscribe)
        self.gossip: Any = None

    def _subscribe(self, name: str, validate: Any, handler: Any, *, include_own: bool = False) -> None:
        if name == topic(RUN, AUDIT_KIND):  # the binding watch's policy and steps topics are not used here
            self.gossip = (validate, handler)

    def deliver(self, data: bytes, origin: str) -> str:
        """What ``Swarm.subscribe`` does with one message: "taken", "ignored" or "refused" (blamed)."""
        validate, handler = self.gossip
        try:
            msg = validate(data, origin)
        except MessageIgnored:
            return "ignored"
        except ProtocolError as exc:
            self.swarm.peerbook.record_rejection(origin, str(exc))
            return "refused"
        asyncio.run(handler(msg, origin))
        return "taken"


def _watch(tmp: Path) -> tuple[AuditWatch, _Runtime]:
    rt = _Runtime(tmp)
    w = AuditWatch(rt)  # type: ignore[arg-type]  # the stand-in has what the watch uses
    asyncio.run(w.start())
    return w, rt


def test_seal_verdict_dates_it_and_undated_verdicts_still_decode() -> None:
    from intellect_node.protocol.audits import open_verdict

    before = now_ms()
    v, _ = open_verdict(seal_verdict(AUDITOR, _verdict(1, "pass")), run_id=RUN, auditors=None)
    assert isinstance(v.time_ms, int) and before <= v.time_ms <= now_ms()
    assert b"time_ms" not in msgspec.msgpack.encode(_verdict(1, "pass"))  # an older auditor's bytes
    undated = AUDITOR.seal("intellect/audit/1", _verdict(1, "pass"))
    v, _ = open_verdict(undated, run_id=RUN, auditors=None)
    assert v.time_ms is msgspec.UNSET


def test_replayed_verdicts_do_not_get_the_runs_validator_banned(tmp_path: Path) -> None:
    """The issue's run: the auditor said ``unavailable`` about a step, then ``pass``; a fresh key
    publishes the first verdict again 110 times, and the auditor's own libp2p message of it is
    forwarded again as often (origin: the auditor)."""
    w, rt = _watch(tmp_path)
    book = rt.swarm.peerbook
    unavailable = seal_verdict(AUDITOR, _verdict(1, "unavailable"))
    assert rt.deliver(unavailable, AUDITOR.peer_id) == "taken"
    assert rt.deliver(seal_verdict(AUDITOR, _verdict(1, "pass")), AUDITOR.peer_id) == "taken"
    assert w.tally.counts == {"passed": 1, "failed": 0, "unavailable": 0}
    for _ in range(110):
        assert rt.deliver(unavailable, MALLORY.peer_id) == "refused"  # not its publisher's to publish
        assert rt.deliver(unavailable, AUDITOR.peer_id) == "ignored"  # a repeat
    assert book.rejections(AUDITOR.peer_id)[0] == 0 and not book.is_banned(AUDITOR.peer_id)
    assert book.is_banned(MALLORY.peer_id)  # the publisher of someone else's verdicts is
    assert w.tally.counts == {"passed": 1, "failed": 0, "unavailable": 0} and not w.refusal()
    assert w.status()["ignored_verdicts"] == {"stale": 0, "repeat": 110}


def test_an_older_unavailable_is_superseded_not_a_contradiction(tmp_path: Path) -> None:
    """Even one this node did not hear before (it joined after): unavailable never contradicts."""
    w, rt = _watch(tmp_path)
    assert rt.deliver(seal_verdict(AUDITOR, _verdict(1, "pass")), AUDITOR.peer_id) == "taken"
    assert rt.deliver(seal_verdict(AUDITOR, _verdict(1, "unavailable")), AUDITOR.peer_id) == "taken"
    assert rt.swarm.peerbook.rejections(AUDITOR.peer_id)[0] == 0
    assert w.tally.counts == {"passed": 1, "failed": 0, "unavailable": 0}


def test_stale_verdicts_are_ignored_and_a_contradiction_takes_two_signed_verdicts(tmp_path: Path) -> None:
    w, rt = _watch(tmp_path)
    stale = seal_verdict(AUDITOR, _verdict(1, "fail", time_ms=now_ms() - OLD))
    ahead = seal_verdict(AUDITOR, _verdict(1, "fail", time_ms=now_ms() + OLD))
    assert rt.deliver(stale, AUDITOR.peer_id) == "ignored" and rt.deliver(ahead, AUDITOR.peer_id) == "ignored"
    assert w.tally.audited == 0 and not w.refusal()
    assert rt.deliver(seal_verdict(AUDITOR, _verdict(2, "pass")), AUDITOR.peer_id) == "taken"
    fail = seal_verdict(AUDITOR, _verdict(2, "fail"))
    assert rt.deliver(fail, AUDITOR.peer_id) == "taken"  # two signed verdicts that disagree: blamed once
    assert rt.deliver(fail, AUDITOR.peer_id) == "ignored"  # and its repeats are only repeats
    count, reasons = rt.swarm.peerbook.rejections(AUDITOR.peer_id)
    assert count == 1 and "contradicts the pass" in reasons[0]
    assert w.status()["ignored_verdicts"] == {"stale": 2, "repeat": 1}


# -- 3. the run's own peers are never banned by counts ----------------------------------------------

def test_the_runs_peers_are_never_banned_by_rejection_counts() -> None:
    cfg = build_config(run={"run_id": RUN, "trainer_peer_id": TRAINER.peer_id,
                            "validator_peer_ids": [AUDITOR.peer_id],
                            "auditor_peer_ids": [MALLORY.peer_id]})
    role_peers = cfg.run.role_peers
    assert role_peers == {TRAINER.peer_id, AUDITOR.peer_id, MALLORY.peer_id}
    book = PeerBook("12D3KooWself", run_peers=role_peers)
    stranger = SigningKey(bytes([24]) * 32).peer_id
    for _ in range(3 * AUTO_BAN_AFTER):
        for peer in (*role_peers, stranger):
            book.record_rejection(peer, "bad chunk")
    assert book.is_banned(stranger)
    for peer in role_peers:
        assert not book.is_banned(peer) and book.rejections(peer)[0] == 3 * AUTO_BAN_AFTER  # still shown
    book.ban(TRAINER.peer_id, "the operator's word")  # an explicit ban still holds
    assert book.is_banned(TRAINER.peer_id)


def test_the_signed_contents_remembered_for_repeats_are_bounded() -> None:
    from intellect_node.protocol.freshness import SeenDigests

    seen = SeenDigests(limit=4)
    for i in range(6):
        seen.take(AUDITOR.peer_id, bytes([i]), what="x")
    with pytest.raises(MessageIgnored) as exc:
        seen.take(AUDITOR.peer_id, bytes([5]), what="x")
    assert exc.value.kind == "repeat"
    seen.take(MALLORY.peer_id, bytes([5]), what="x")  # the same bytes from another signer: not a repeat
    seen.take(AUDITOR.peer_id, bytes([0]), what="x")  # forgotten past the limit: taken once more
    assert len(seen._seen) == 4
