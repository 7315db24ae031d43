"""The trainer's inbox (``roles/trainer/inbox.py``) on real files: a batch is checked for rollouts admitted
before, persisted and journaled before it is queued, and a trainer started again finds exactly the batches
that were admitted and not consumed, in arrival order."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from intellect_node.errors import ProtocolError
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rollout import RolloutBatch, RolloutRecord, SamplingParams, encode_batch
from intellect_node.roles.common.seen import rollout_keys
from intellect_node.roles.trainer.admitted import AdmittedJournal
from intellect_node.roles.trainer.inbox import DuplicateRollouts, Inbox, StepJournal


def _rec(problem: str, rid: str, worker: str = "w1") -> RolloutRecord:
    """A structurally valid record (the inbox never looks inside beyond its keys)."""
    return RolloutRecord(run_id="r", rollout_id=rid, task_id="add3", problem_id=problem, prompt_tokens=[1],
                         completion_tokens=[2], logprobs=[-0.1], sampling=SamplingParams(), policy_version=0,
                         checkpoint_cid=cid_of(b"ckpt"), dtype="float32", reward=0.0, proofs=[b"p"],
                         worker=worker)


def _data(records: list[RolloutRecord]) -> bytes:
    return encode_batch(RolloutBatch(run_id="r", policy_version=0, rollouts=records))


def _groups_of(batch: RolloutBatch, worker: str, version: int) -> list[list[Any]]:
    """The trainer's check stands here: a batch must be its worker's."""
    if any(r.worker != worker for r in batch.rollouts):
        raise ProtocolError("batch does not match its verdict")
    return [[r.rollout_id] for r in batch.rollouts]  # rollout ids stand for the samples


def test_admit_persists_refuses_repeats_and_reloads_after_a_crash(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    box, journal = tmp_path / "inbox", tmp_path / "admitted.jsonl"
    first = [_rec("p1", "a"), _rec("p1", "b")]
    second = [_rec("p2", "c")]

    async def admit() -> None:
        inbox = Inbox(box, journal)
        assert await inbox.admit("cid1", "w1", 0, _data(first), rollout_keys(first)) == 1
        assert await inbox.admit("cid2", "w1", 0, _data(second), rollout_keys(second)) == 2
        # The same rollouts under another blob name (or mixed into another batch) are refused, and
        # nothing of that batch is kept.
        again = [second[0], _rec("p3", "d")]
        with pytest.raises(DuplicateRollouts, match="sample 0 of p2 at v0 was admitted before"):
            await inbox.admit("cid3", "w1", 0, _data(again), rollout_keys(again))
        assert not (box / "cid3.batch").exists()
        assert not inbox.admitted.holds(0, rollout_keys([_rec("p3", "d")]))

    asyncio.run(admit())
    assert json.loads((box / "cid2.json").read_text())["seq"] == 2
    # Killed before cid2's journal line was written: only cid1's line survives.
    journal.write_text(journal.read_text().strip().split("\n")[0] + "\n")
    # Another worker's records under w1's name, and a damaged entry: both skipped on reload.
    (box / "cid4.batch").write_bytes(_data([_rec("p9", "x", worker="w2")]))
    (box / "cid4.json").write_text(json.dumps({"cid": "cid4", "worker": "w1", "version": 0, "seq": 3}))
    (box / "junk.json").write_text("{not json")

    restarted = Inbox(box, journal)
    found = restarted.reload({"cid1"}, _groups_of)  # cid1 is in the checkpoint's consumed set
    assert [(a.cid, a.worker, a.version, a.seq) for a in found] == [("cid2", "w1", 0, 2)]
    groups: list[list[Any]] = found[0].groups  # _groups_of's rollout ids
    assert groups == [["c"]]
    assert restarted.seq == 2  # new arrivals are numbered after the re-queued ones
    assert not (box / "cid1.batch").exists() and not (box / "cid1.json").exists()
    # cid2's keys are back in memory and in the journal, so a second crash keeps them too.
    assert restarted.admitted.holds(0, rollout_keys(second))
    assert AdmittedJournal(journal).holds(0, rollout_keys(second))
    skipped = [r.message for r in caplog.records if r.levelno == logging.WARNING and "skipped" in r.message]
    assert len(skipped) == 2
    assert any("cid4.json" in m for m in skipped) and any("junk.json" in m for m in skipped)

    restarted.drop("cid2")
    assert not list(box.glob("cid2.*"))


def test_step_journal_survives_a_torn_line_and_trims_to_the_entries_after_a_checkpoint(
        tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    journal = StepJournal(path)
    assert journal.seq == 0 and journal.after(0) == []
    journal.append(0, ["a", "b"], [])
    journal.append(1, ["c"], ["old"])
    journal.append(2, ["d"], [])
    with open(path, "a") as f:
        f.write('{"seq": 4, "vers')  # SIGKILL mid-append: that step had not trained
    again = StepJournal(path)
    assert again.seq == 3
    assert [(e.seq, e.version, e.taken, e.stale) for e in again.after(1)] == [
        (2, 1, ("c",), ("old",)), (3, 2, ("d",), ())]
    again.trim(2)  # a checkpoint covers entries 1 and 2
    assert [e.seq for e in StepJournal(path).entries] == [3]
    again.trim(3)
    emptied = StepJournal(path)
    assert emptied.entries == [] and emptied.seq == 0  # the trainer numbers on from its checkpoint's seq
