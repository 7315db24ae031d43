"""``roles/auditor/drops.py``: the reasons a record gives for dropped batches, checked on the batches.

In process, on batches of real signed records and the trainer's own check (``inputs.trainer_refusal``
over the run's re-scoring, the embedded task and the worker's assignment):

- honest drops hold: a batch outside its worker's assignment (``not_assigned``), one of another task
  (``wrong_task``), a batch repeating one the same step took and one repeating a batch a later step took
  (``duplicate``, judged at its deadline);
- an honest batch recorded dropped as ``not_assigned`` or ``wrong_task`` fails the step that says so, and
  one recorded ``duplicate`` fails the first step at its deadline, each naming the batch;
- a dropped batch not to be had, and a duplicate judged while a record that could name its original was
  not heard, are ``unavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from intellect_node.protocol.signing import SigningKey
from intellect_node.protocol.steps import DroppedBatch, StepBatch, StepRecord, check_record
from intellect_node.roles.auditor.drops import DropCheck
from intellect_node.roles.auditor.evidence import DROP_SLACK_VERSIONS
from intellect_node.roles.auditor.inputs import run_rescorer, trainer_refusal
from intellect_node.roles.auditor.replay import Outcome
from tests.roles.test_audit_evidence_units import H0, H1, SETTINGS
from tests.security._roles_inproc import GROUP, RUN, assigned, batch_bytes, config, record

W = SigningKey(bytes([9]) * 32)
TRAINER = SigningKey(bytes([10]) * 32)
CFG = config(TRAINER.peer_id, [])
ASYNC = CFG.run.async_level
DEADLINE = ASYNC + 1 + DROP_SLACK_VERSIONS  # of a batch of version 0


class Batches:
    """Batch bytes by CID: what the auditor can fetch (the others are not to be had)."""

    def __init__(self) -> None:
        self.held: dict[str, bytes] = {}

    def add(self, window: int = 0, *, problem_version: int = 0, task_id: str | None = None,
            reverse: bool = False, base: int = 0) -> str:
        """A batch of ``W`` at version 0 holding one group of its window ``window`` at
        ``problem_version`` (0: its own assignment) of the run's task (or ``task_id``); ``reverse``:
        the same records in another order (another blob, the same rollouts); ``base``: where the
        sample indices start (another group of the same problem)."""
        pid = assigned(W, problem_version, window)
        recs = [record(W, pid, base + i, task_id=task_id) for i in range(GROUP)]
        cid, data = batch_bytes(recs[::-1] if reverse else recs)
        self.held[cid] = data
        return cid

    async def fetch(self, cid: str, worker: str) -> bytes | None:
        return self.held.get(cid)


def _rec(seq: int, base: int, taken: Sequence[str] = (), dropped: dict[str, str] | None = None) -> StepRecord:
    """A record at base version ``base`` that took ``taken`` (a step, or none: nothing trained) and names
    ``dropped`` (CID -> reason)."""
    return check_record(StepRecord(
        run_id=RUN, seq=seq, step=seq, base_version=base, base_hash=H0, version=base + bool(taken),
        checkpoint_hash=H1 if taken else H0, no_signal="" if taken else "no_groups",
        batches=[StepBatch(cid=c, worker=W.peer_id, groups=1, trained=[0]) for c in taken], settings=SETTINGS,
        dropped=[DroppedBatch(cid=c, worker=W.peer_id, reason=r) for c, r in (dropped or {}).items()]))


def _audit(records: list[StepRecord], batches: Batches, *, heard: list[StepRecord] | None = None,
           check: DropCheck | None = None) -> list[tuple[Outcome, str]]:
    """Every record heard (``heard``, default ``records``), then each of ``records`` checked in order."""
    check = check or DropCheck(trainer_refusal(run_rescorer(CFG)), ASYNC)
    for rec in heard if heard is not None else records:
        check.named(rec)

    async def main() -> list[tuple[Outcome, str]]:
        return [await check.check(rec, batches.fetch) for rec in records]

    return asyncio.run(main())


def _chain(first: StepRecord, *, until: int = DEADLINE) -> list[StepRecord]:
    """``first`` and a record at each base version after it up to ``until``."""
    return [first] + [_rec(first.seq + b, b) for b in range(first.base_version + 1, until + 1)]


def test_drops_that_hold_pass() -> None:
    b = Batches()
    taken, later = b.add(0), b.add(1)
    recs = _chain(_rec(1, 0, [taken], {
        b.add(0, problem_version=1): "not_assigned",  # a problem of another version's assignment
        b.add(2, task_id="other"): "wrong_task",
        b.add(0, reverse=True): "duplicate",  # the batch this step took, under another blob name
        b.add(1, reverse=True): "duplicate",  # a batch still queued: the next step takes it
    }))
    recs[1] = _rec(2, 1, [later])
    check = DropCheck(trainer_refusal(run_rescorer(CFG)), ASYNC)
    out = _audit(recs, b, check=check)
    assert out == [("pass", "")] * len(recs), out
    assert check.checked == 4  # each reason checked and found to hold (the duplicates at their deadline)


def test_an_honest_batch_claimed_not_assigned_or_wrong_task_fails() -> None:
    for reason in ("not_assigned", "wrong_task"):
        b = Batches()
        honest = b.add(0)
        (outcome, why), = _audit([_rec(1, 0, [], {honest: reason})], b)
        assert outcome == "fail" and honest in why and f"({reason})" in why, (reason, why)
        assert "trainer's own check takes it" in why


def test_an_honest_batch_claimed_duplicate_fails_at_its_deadline() -> None:
    b = Batches()
    other = b.add(1)  # another batch of the worker, trained: it repeats none of the claimed one
    honest = b.add(0)
    recs = _chain(_rec(1, 0, [other], {honest: "duplicate"}))
    out = _audit(recs, b)
    assert [o for o, _ in out] == ["pass"] * (len(recs) - 1) + ["fail"], out
    assert honest in out[-1][1] and "no batch a record took or named stale" in out[-1][1]


def test_what_cannot_be_checked_is_unavailable() -> None:
    b = Batches()
    gone = "bafkr4i" + "a" * 52  # a dropped batch nobody serves
    (outcome, why), = _audit([_rec(1, 0, [], {gone: "not_assigned"})], b)
    assert outcome == "unavailable" and gone in why
    # A duplicate whose original some record unheard here may have taken: not judged a failure.
    honest = b.add(0)
    recs = _chain(_rec(1, 0, [], {honest: "duplicate"}))
    out = _audit(recs, b, heard=[r for r in recs if r.seq != 2])
    assert [o for o, _ in out] == ["pass"] * (len(recs) - 1) + ["unavailable"], out
    assert "not every record" in out[-1][1]
