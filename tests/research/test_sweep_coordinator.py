"""The sweep coordinator as a pure state machine: no duplicates, spot checks, forgers banned and their
work redone, vanished peers' jobs reassigned, one-worker sweeps, resume from the journal, aggregation."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.protocol.sweep import job_id
from intellect_node.research import sweep as S
from intellect_node.research.sweep.coordinator import ResultRecord, SweepEvent
from intellect_node.research.sweep.coordinator import _digest_of as digest_of

SALT = b"test-salt"


def truth(jid: str) -> ResultRecord:
    """A stand-in for running the job: deterministic per job, like the real model."""
    h = hashlib.sha256(jid.encode()).hexdigest()
    return {"polysemantic": int(h[:2], 16) % 7, "sign_hash": h, "final_loss": 0.5, "fourth_norm": [],
            "seconds": 1.0}


def forged(jid: str) -> ResultRecord:
    return {**truth(jid), "polysemantic": 3, "sign_hash": "f" * 64}


def drive(coord: S.Coordinator, peers: list[str], *, liars: frozenset[str] | set[str] = frozenset(),
          now: float = 1000.0, rounds: int = 500, journal: list[SweepEvent] | None = None) -> float:
    """Round-robin: each peer claims one job and returns its result at once. Returns the final time."""
    for _ in range(rounds):
        if coord.finished():
            break
        progressed = False
        for p in peers:
            if p in coord.banned:
                continue
            for g in coord.claim(p, [], 1, now):
                rec = forged(g.job_id) if p in liars else truth(g.job_id)
                coord.result(p, g.job_id, rec, now)
                progressed = True
        now += 1.0
        if not progressed:
            now += coord.check_grace_s + 1
        coord.tick(now)
        if journal is not None:
            journal.extend(coord.drain())
    return now


def test_grids_have_the_issue_sizes_and_unique_ids() -> None:
    assert len(S.grid("smoke")) == 40 and len(S.grid("paper")) == 256 and len(S.grid("noise")) == 35
    for name in S.GRIDS:
        ids = [job_id(s) for s in S.grid(name)]
        assert len(set(ids)) == len(ids)
    assert {s.m for s in S.grid("paper")} == set(range(256, 4097, 256))
    assert S.theory(64, 256) == 4.0
    with pytest.raises(ConfigError, match="--grid"):
        S.grid("huge")


def test_spot_check_selection_is_exact_and_secret() -> None:
    ids = [job_id(s) for s in S.grid("smoke")]
    a = S.spot_checked(ids, SALT, 0.05)
    assert len(a) == 2 and a == S.spot_checked(ids, SALT, 0.05)
    assert S.spot_checked(ids, b"other", 0.05) != a or S.spot_checked(ids, b"third", 0.05) != a
    assert S.spot_checked(ids, SALT, 0.0) == set() and S.spot_checked(ids, SALT, 1.0) == set(ids)
    with pytest.raises(ConfigError):
        S.spot_checked(ids, SALT, 1.5)


def test_honest_sweep_no_duplicates_checks_by_other_peers() -> None:
    coord = S.Coordinator(S.grid("smoke"), salt=SALT)
    events: list[SweepEvent] = []
    drive(coord, ["A", "B", "C"], journal=events)
    assert coord.finished() and coord.counts()["done"] == 40
    grants = Counter(ev["job"] for ev in events if ev["e"] == "grant")
    checked = {j for j, job in coord.jobs.items() if job.checked}
    assert len(checked) == 2
    for jid, n in grants.items():
        assert n == (2 if jid in checked else 1)
    for row in coord.rows():
        assert row["polysemantic"] == truth(row["job_id"])["polysemantic"]
        if row["job_id"] in checked:
            assert row["check"] == "agreed" and len(set(row["peers"])) == 2
    # Checks are granted only after the first result (a worker never holds both executions at once).
    first_result: dict[str, Any] = {}
    for ev in events:
        if ev["e"] == "result":
            first_result.setdefault(ev["job"], events.index(ev))
    for i, ev in enumerate(events):
        if ev["e"] == "grant" and ev["role"] == S.CHECK:
            assert first_result[ev["job"]] < i


def test_forger_caught_by_spot_check_banned_and_redone() -> None:
    coord = S.Coordinator(S.grid("smoke"), salt=SALT)
    checked = sorted((job.index, jid) for jid, job in coord.jobs.items() if job.checked)
    # Mallory claims first and takes a checked job plus five others, all forged.
    mallory_jobs = [checked[0][1]]
    g = coord.claim("mallory", mallory_jobs, 6, 1000.0)
    assert len(g) == 6 and g[0].job_id == checked[0][1]
    for grant in g:
        assert coord.result("mallory", grant.job_id, forged(grant.job_id), 1000.0).accepted
    forged_ids = {grant.job_id for grant in g}
    assert all(coord.status(j) == "done" for j in forged_ids if not coord.jobs[j].checked)
    drive(coord, ["alice", "bob"], now=1001.0)
    assert coord.banned.keys() == {"mallory"}
    assert "disagrees" in coord.banned["mallory"]
    assert coord.finished() and coord.counts()["done"] == 40
    for row in coord.rows():
        assert "mallory" not in row["peers"]
        assert (row["polysemantic"], row["sign_hash"]) == digest_of(truth(row["job_id"]))
    # Mallory's results after the ban are refused; it gets no more work.
    assert coord.claim("mallory", [], 1, 2000.0) == []
    assert coord.result("mallory", g[1].job_id, truth(g[1].job_id), 2000.0).reason == "banned"


def test_forger_as_checker_is_outvoted() -> None:
    coord = S.Coordinator(S.grid("tiny"), salt=SALT, check_fraction=1.0)
    jid = coord.claim("alice", [], 1, 0.0)[0].job_id
    coord.result("alice", jid, truth(jid), 0.0)
    assert coord.claim("mallory", [jid], 1, 1.0)[0].role == S.CHECK
    out = coord.result("mallory", jid, forged(jid), 1.0)
    assert out.accepted and not out.banned and coord.status(jid) == "open"
    g = coord.claim("bob", [jid], 1, 2.0)[0]
    assert g.job_id == jid and g.role == S.TIEBREAK
    assert coord.result("bob", jid, truth(jid), 2.0).banned == ("mallory",)
    assert coord.status(jid) == "done"


def test_vanished_peer_jobs_reassigned_after_deadline_or_heartbeat_loss() -> None:
    coord = S.Coordinator(S.grid("tiny"), salt=SALT, check_fraction=0.0)
    g = coord.claim("ghost", [], 2, 0.0)
    assert len(g) == 2
    assert all(job_id(x.spec) == x.job_id for x in g)
    # Before the deadline nobody else gets them.
    others = coord.claim("alice", [x.job_id for x in g], 6, 1.0)
    assert {x.job_id for x in others}.isdisjoint({x.job_id for x in g}) and len(others) == 4
    coord.tick(g[0].deadline + 1)
    again = coord.claim("bob", [], 6, g[0].deadline + 2)
    assert {x.job_id for x in again} == {x.job_id for x in g}
    # The heartbeat path: bob goes silent, his grants go back at once.
    assert sorted(coord.peer_gone("bob", g[0].deadline + 3)) == sorted(x.job_id for x in g)
    # A late result of the expired ghost still counts (it was granted the job).
    assert coord.result("ghost", g[0].job_id, truth(g[0].job_id), g[0].deadline + 4).accepted
    drive(coord, ["alice"], now=g[0].deadline + 5)
    assert coord.finished() and coord.counts()["done"] == 6


def test_one_worker_completes_checks_waived_and_recorded() -> None:
    coord = S.Coordinator(S.grid("tiny"), salt=SALT, check_fraction=0.5, check_grace_s=30.0)
    drive(coord, ["solo"])
    assert coord.finished()
    rows = coord.rows()
    assert all(r["status"] == "done" for r in rows)
    assert Counter(r["check"] for r in rows) == {"none": 3, "waived": 3}


def test_dispute_without_a_third_peer_is_abandoned_not_hidden() -> None:
    coord = S.Coordinator(S.grid("tiny"), salt=SALT, check_fraction=1.0, check_grace_s=30.0)
    drive(coord, ["alice", "mallory"], liars={"mallory"})
    assert coord.finished()
    rows = coord.rows()
    assert all(r["status"] == "unresolved" for r in rows)
    assert all(len(r["votes"]) == 2 for r in rows)
    assert not coord.banned  # one against one proves nothing


def test_unsolicited_duplicate_and_impossible_results() -> None:
    coord = S.Coordinator(S.grid("tiny"), salt=SALT, check_fraction=0.0)
    jid = next(iter(coord.jobs))
    assert coord.result("eve", jid, truth(jid), 0.0).reason.startswith("result for a job not granted")
    assert coord.result("eve", "bafkreinotajob", truth(jid), 0.0).reason == "unknown job"
    assert coord.rejections["eve"] == 2
    g = coord.claim("alice", [jid], 1, 0.0)[0]
    assert coord.result("alice", jid, truth(jid), 1.0).accepted
    assert coord.result("alice", jid, truth(jid), 1.0).reason == "duplicate"
    g2 = coord.claim("carol", [], 1, 2.0)[0]
    bad: ResultRecord = {**truth(g2.job_id), "polysemantic": g2.spec.m + 1}
    out = coord.result("carol", g2.job_id, bad, 2.0)
    assert not out.accepted and out.banned == ("carol",) and "carol" in coord.banned
    assert coord.status(g.job_id) == "done" and coord.status(g2.job_id) == "open"


def test_resume_from_journal_gives_the_same_state_and_finishes(tmp_path: Path) -> None:
    jobs = S.grid("smoke")
    full = S.Coordinator(jobs, salt=SALT)
    drive(full, ["A", "B", "C"], liars={"C"})

    coord = S.Coordinator(jobs, salt=SALT)
    journal = S.Journal(tmp_path / "journal.jsonl")
    journal.create(coord.header())
    now = 1000.0
    for i in range(12):  # part of the sweep, journalled as it goes; a grant is left in flight
        for p in ("A", "B", "C"):
            for g in coord.claim(p, [], 1, now):
                if i < 11:
                    coord.result(p, g.job_id, forged(g.job_id) if p == "C" else truth(g.job_id), now)
        journal.append(coord.drain())
        now += 1
    journal.close()
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"e": "result", "t": 1')  # a torn last line: the crash hit mid-append
    header, events = S.Journal(tmp_path / "journal.jsonl").load()
    resumed = S.Coordinator.restore(header, events)
    assert resumed.rows() == coord.rows() and resumed.counts() == coord.counts()
    assert resumed.banned == coord.banned
    assert resumed.counts()["inflight"] >= 2  # the last round's grants (C may be banned by then)
    drive(resumed, ["A", "B", "C"], liars={"C"}, now=now + 10_000)  # past the in-flight deadlines
    assert resumed.finished()
    assert [(r["job_id"], r["polysemantic"], r["sign_hash"]) for r in resumed.rows()] == \
        [(r["job_id"], r["polysemantic"], r["sign_hash"]) for r in full.rows()]


def test_journal_refuses_overwrite_and_garbage(tmp_path: Path) -> None:
    j = S.Journal(tmp_path / "j.jsonl")
    with pytest.raises(ConfigError, match="--resume"):
        j.load()
    j.create({"e": "header"})
    with pytest.raises(ConfigError, match="--resume"):
        j.create({"e": "header"})
    (tmp_path / "k.jsonl").write_text('{"e": "grant"}\n')
    with pytest.raises(ProtocolError):
        S.Journal(tmp_path / "k.jsonl").load()
    with pytest.raises(ProtocolError):
        S.Coordinator.restore({"e": "header", "jobs": [{"variant": "poly"}]}, [])


def test_summary_table_and_outputs(tmp_path: Path) -> None:
    coord = S.Coordinator(S.grid("tiny"), salt=SALT, check_fraction=0.0)
    drive(coord, ["A", "B"])
    summary = S.write_outputs(tmp_path, coord, meta={"grid": "tiny"})
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["status"] == "done" for r in rows)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["grid"] == "tiny" and on_disk["configs"] == summary["configs"]
    c16 = next(c for c in summary["configs"] if c["m"] == 16)
    counts = [truth(r["job_id"])["polysemantic"] for r in rows if r["m"] == 16]
    mean = sum(counts) / 3
    assert c16["counts"] == counts and c16["seeds"] == [0, 1, 2] and c16["theory"] == 4.0
    assert c16["mean"] == pytest.approx(mean)
    assert c16["std"] == pytest.approx((sum((x - mean) ** 2 for x in counts) / 2) ** 0.5)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 16 | 16 | 3 |" in S.table(summary)


def test_noise_summary_curves(tmp_path: Path) -> None:
    rows = [{"job_id": str(i), "variant": "noise", "noise": "bernoulli", "sigma": 0.1, "seed": i,
             "status": "done", "polysemantic": 0, "fourth_norm": [[0, 0.2], [10, 0.2 + 0.1 * i]]}
            for i in range(3)]
    s = S.summarize(rows)
    (c,) = s["noise_curves"]
    assert c["steps"] == [0, 10] and c["mean_curve"] == pytest.approx([0.2, 0.3])
    assert c["final_mean"] == pytest.approx(0.3) and c["final_std"] == pytest.approx(0.1)
    S.plot(s, tmp_path / "noise.png")
    assert (tmp_path / "noise.png").stat().st_size > 1000


def test_real_noise_and_poly_runs_are_accepted_and_agree() -> None:
    jobs = [S.noise_job("bernoulli", 0.1, 0, steps=600, record_every=100), S.poly_job(8, 16, 1, steps=300)]
    coord = S.Coordinator(jobs, salt=SALT, check_fraction=1.0)
    now = 0.0
    for peer in ("alice", "bob"):
        for g in coord.claim(peer, [], 2, now):
            r = S.execute(g.spec)
            rec: ResultRecord = {"polysemantic": r.polysemantic, "sign_hash": r.sign_hash,
                                 "final_loss": r.final_loss, "fourth_norm": [list(p) for p in r.fourth_norm],
                                 "seconds": 0.0}
            assert coord.result(peer, g.job_id, rec, now).accepted
    assert coord.finished() and all(r["check"] == "agreed" for r in coord.rows())
    noise_row = coord.rows()[0]
    assert [s for s, _ in noise_row["fourth_norm"]] == list(range(0, 601, 100))
