"""Rollout keys and the trainer's journal of admitted rollouts (``roles/common/seen.py``,
``roles/trainer/admitted.py``): one count per (run, version, worker, problem, sample index) and rollout ID,
remembered across a SIGKILL, bounded by version."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.rollout import RolloutRecord, SamplingParams
from intellect_node.roles.common.seen import BoundedMap, SeenRollouts, describe_key, rollout_keys
from intellect_node.roles.trainer.admitted import AdmittedJournal
from tests.support.common import REPO

CKPT = cid_of(b"ckpt")


def _rec(problem: str, rid: str, worker: str = "w1") -> RolloutRecord:
    return RolloutRecord(run_id="r", rollout_id=rid, task_id="add3", problem_id=problem, prompt_tokens=[1],
                         completion_tokens=[2], logprobs=[-0.1], sampling=SamplingParams(), policy_version=0,
                         checkpoint_cid=CKPT, dtype="float32", reward=0.0, proofs=[b"p"], worker=worker)


def test_keys_number_samples_per_problem_and_scope_ids_by_worker() -> None:
    keys = rollout_keys([_rec("p1", "a"), _rec("p1", "b"), _rec("p2", "c")])
    assert len(keys) == 6 and len(set(keys)) == 6
    assert describe_key(keys[2]) == "sample 1 of p1" and describe_key(keys[5]) == "rollout ID c"
    # The same problem's first sample in another batch is the same rollout, whatever its ID says.
    again = rollout_keys([_rec("p1", "zzz")])
    assert again[0] == keys[0] and again[1] not in keys
    # Another worker's records never collide with ours.
    assert not set(rollout_keys([_rec("p1", "a", worker="w2")])) & set(keys)


def test_seen_rollouts_per_version_and_bounded() -> None:
    seen = SeenRollouts()
    k = rollout_keys([_rec("p1", "a")])
    seen.add(3, k)
    assert seen.first_seen(3, k) == k[0] and seen.first_seen(4, k) is None
    seen.discard(3, k)
    assert seen.first_seen(3, k) is None and len(seen) == 0
    for v in range(10):
        seen.add(v, [f"x{v}"])
    assert seen.forget_below(7) == list(range(7)) and seen.versions() == [7, 8, 9]
    m: BoundedMap[str, int] = BoundedMap(3)
    for i in range(10):
        m.put(str(i), i)
    assert len(m) == 3 and "9" in m and "0" not in m


def test_journal_reloads_skips_a_torn_line_and_compacts(tmp_path: Path) -> None:
    path = tmp_path / "admitted.jsonl"
    j = AdmittedJournal(path)
    k0, k1, k2 = (rollout_keys([_rec(f"p{i}", f"id{i}")]) for i in range(3))

    async def fill() -> None:
        await j.append(0, "w1", "c0", k0)
        await j.append(1, "w1", "c1", k1)
        await j.append(2, "w1", "c2", k2)

    asyncio.run(fill())
    with open(path, "a") as f:
        f.write('{"v": 2, "w": "w1", "cid": "c3", "k": ["s\\u0000r')  # killed mid-write
    j2 = AdmittedJournal(path)
    assert j2.holds(0, k0) and j2.holds(1, k1) and j2.holds(2, k2) and j2.versions() == [0, 1, 2]
    assert asyncio.run(j2.compact(2)) == 2
    j3 = AdmittedJournal(path)
    assert j3.versions() == [2] and j3.holds(2, k2) and not j3.holds(0, k0)
    assert "c3" not in path.read_text()  # the torn line went with the rewrite
    assert oct(path.stat().st_mode & 0o777) == "0o600"


_CHILD = """
import asyncio, sys
from pathlib import Path
from intellect_node.roles.trainer.admitted import AdmittedJournal

async def main():
    j = AdmittedJournal(Path(sys.argv[1]))
    i = 0
    while True:
        await j.append(i // 10, "w", f"c{i}", [f"k{i}a", f"k{i}b"])
        print(i, flush=True)  # acknowledged: from here on the keys must survive anything
        i += 1
        if i % 50 == 0:
            await j.compact(i // 10 - 2)

asyncio.run(main())
"""


def test_journal_keeps_every_acknowledged_key_across_sigkill(tmp_path: Path) -> None:
    """A real process appends and compacts in a loop, printing each acknowledgment; SIGKILL it at a
    random point: every acknowledged key of the versions kept is there on reload."""
    path = tmp_path / "admitted.jsonl"
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True,
                                cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout is not None
        acked = -1
        target = 120 + 37 * round_
        while acked < target:
            line = proc.stdout.readline()
            assert line, "child exited early"
            acked = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # The child may have run ahead of our reading (a loaded machine) and compacted again: every line
        # it printed before the kill was acknowledged, so the rest of its output says how far it got.
        acked = max([acked] + [int(line) for line in proc.stdout.read().split()])
        j = AdmittedJournal(path)
        floor = max(0, (acked + 1) // 50 * 50 // 10 - 2)
        for i in range(acked + 1):
            if i // 10 >= floor:
                assert j.holds(i // 10, [f"k{i}a", f"k{i}b"]), (round_, i, acked)
        path.unlink()


def test_the_run_allowlist_is_checked_in_config_gossip_and_at_worker_start(tmp_path: Path) -> None:
    import pytest

    from intellect_node.config import build_config
    from intellect_node.errors import ConfigError, ProtocolError
    from intellect_node.protocol.rl import RolloutNotice, notice_validator, seal_notice
    from intellect_node.protocol.signing import SigningKey
    from intellect_node.roles.common.run import require_allowed

    member, stranger = SigningKey.generate(), SigningKey.generate()
    with pytest.raises(ConfigError) as e:
        build_config({"run": {"worker_allowlist": [member.peer_id, "12D3KooWnope"]}})
    assert "run.worker_allowlist" in str(e.value) and "12D3KooWnope" in str(e.value)
    cfg = build_config({"run": {"worker_allowlist": [member.peer_id]}})
    require_allowed(cfg, member.peer_id)
    with pytest.raises(ConfigError, match="not on run.worker_allowlist"):
        require_allowed(cfg, stranger.peer_id)
    require_allowed(build_config({}), stranger.peer_id)  # an open run

    validate = notice_validator("r", allowed=frozenset({member.peer_id}))
    n = RolloutNotice(run_id="r", batch_cid=CKPT, policy_version=0, n_rollouts=8, batch_bytes=100)
    assert validate(seal_notice(member, n), member.peer_id)[1] == member.peer_id
    with pytest.raises(ProtocolError, match="^not_allowed"):
        validate(seal_notice(stranger, n), stranger.peer_id)
