"""Checkpoints: exact round trip, and a SIGKILLed writer always leaves a complete, consistent checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from intellect_node.errors import IntegrityError
from intellect_node.trainer.checkpoint import TrainerState, latest_dir, load_checkpoint, save_checkpoint
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, make_optimizer, train_step
from tests.support.common import REPO
from tests.support.grpo import replayed_hash, tiny_llama

torch.set_num_threads(1)


def test_round_trip_restores_weights_optimizer_version_and_consumed(tmp_path: Path) -> None:
    m = tiny_llama(seed=3)
    opt = make_optimizer(m, 1e-2)
    samples = [Sample((1, 3), (4, 5), (-2.0, -2.5), float(i % 2)) for i in range(4)]
    train_step(m, opt, samples, GRPOConfig(group_size=4, token_budget=8, max_grad_norm=1.0))
    save_checkpoint(tmp_path, m, opt, TrainerState(version=5, consumed=frozenset({"b1", "b2"}), step=5))
    m2 = tiny_llama(seed=4)
    opt2 = make_optimizer(m2, 1e-2)
    st = load_checkpoint(tmp_path, m2, opt2)
    assert st is not None and st.version == 5 and st.consumed == {"b1", "b2"} and st.step == 5
    for pa, pb in zip(m.parameters(), m2.parameters()):
        assert torch.equal(pa, pb)
    # The optimizer state came back too: the next step is identical on both.
    train_step(m, opt, samples, GRPOConfig(group_size=4, token_budget=8, max_grad_norm=1.0))
    train_step(m2, opt2, samples, GRPOConfig(group_size=4, token_budget=8, max_grad_norm=1.0))
    for pa, pb in zip(m.parameters(), m2.parameters()):
        assert torch.equal(pa, pb)


def test_no_checkpoint_and_corrupt_latest(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path, tiny_llama()) is None
    (tmp_path / "LATEST").write_text("../etc\n")
    with pytest.raises(IntegrityError):
        load_checkpoint(tmp_path, tiny_llama())


def test_old_checkpoints_pruned(tmp_path: Path) -> None:
    m = tiny_llama()
    for v in range(1, 5):
        save_checkpoint(tmp_path, m, None, TrainerState(version=v), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["v00000003", "v00000004"]
    assert latest_dir(tmp_path) == tmp_path / "v00000004"


WRITER = textwrap.dedent("""
    import os, shutil, signal, sys, traceback
    import torch
    torch.set_num_threads(1)
    from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from tests.support.grpo import tiny_llama

    root, snapshots, points = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = tiny_llama(hidden=64)  # built once: every writer is a fork of this process

    def save(v, stop_at):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(v))  # weights encode the version they belong to
        events = 0

        def count(frame, event, arg):  # every Python and C call and return inside the write
            nonlocal events
            events += 1
            if events == stop_at:
                os.kill(os.getpid(), signal.SIGSTOP)

        sys.setprofile(count)
        state = TrainerState(version=v, consumed=frozenset(f"b{i}" for i in range(v)), step=v)
        save_checkpoint(root, model, None, state)
        sys.setprofile(None)
        return events

    def writer(stop_at, out):
        # Resume from the latest checkpoint, commit the next one, then write the one after, stopped at its
        # event stop_at (0: not stopped; the number of events that write had goes to out).
        st = load_checkpoint(root, model)
        v = 0 if st is None else st.version
        save(v + 1, 0)
        os.write(out, str(save(v + 2, stop_at)).encode())

    def fork(stop_at):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                writer(stop_at, w)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, os.WUNTRACED)
        if os.WIFSTOPPED(status):  # stopped mid-write: killed there
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return None
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        with os.fdopen(r) as f:
            return int(f.read())

    fork(0)
    n = fork(0)  # a write in the steady state (it prunes an older checkpoint), in events
    for i in range(points):  # kill points spread over the whole write, first event to last
        stop_at = 1 + (n - 1) * i // (points - 1)
        assert fork(stop_at) is None, f"a writer was not stopped at event {stop_at} of {n}"
        shutil.copytree(root, os.path.join(snapshots, f"{i:03d}-{stop_at}"))
    print(n)
""")
KILLS = 24
"""Kill points, spread evenly over a checkpoint write's calls and returns."""


def test_sigkill_at_any_moment_leaves_a_consistent_checkpoint(tmp_path: Path) -> None:
    """A writer is killed at points spread over a checkpoint write (between any two of its calls,
    counted by a profile hook), each time after committing one checkpoint more than the last writer. What
    it leaves loads as the checkpoint committed last, or as the one being written once its ``LATEST`` is
    written: weights, version and consumed set of one checkpoint; and the next writer resumes from it."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root, snapshots = tmp_path / "ckpt", tmp_path / "killed"
    snapshots.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script), str(root), str(snapshots), str(KILLS)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    kills = sorted(snapshots.iterdir())
    assert len(kills) == KILLS
    last, outcomes = 4, set()  # two writers ran to the end: v1 to v4
    for snap in kills:
        m = tiny_llama(hidden=64)
        st = load_checkpoint(snap, m)
        # The writer committed last + 1; the kill left that, or last + 2 when it came after LATEST.
        assert st is not None and st.version in (last + 1, last + 2), (snap.name, st)
        # Weights, version and consumed set were committed together.
        assert all(torch.all(p == float(st.version)) for p in m.parameters()), snap.name
        assert st.consumed == {f"b{i}" for i in range(st.version)}
        assert json.loads((latest_dir(snap) / "state.json").read_text())["version"] == st.version  # type: ignore[operator]  # set by now
        outcomes.add(st.version - last)
        last = st.version
    assert outcomes == {1, 2}, "the kills fell on both sides of the commit"


def test_steps_replayed_in_a_new_process_from_a_checkpoint_give_bit_identical_weights(tmp_path: Path) -> None:
    """What a trainer SIGKILLed between checkpoints relies on (``rl.checkpoint_every``,
    roles/trainer/replay.py): the checkpoint's weights and AdamW state plus the same samples in the same order
    reproduce the versions it announced, to the bit, in another process (here, the checkpoint and the first
    three steps are this process's)."""
    root = tmp_path / "ckpt"
    first = replayed_hash(root, fresh=True)
    code = ("import sys; from tests.support.grpo import replayed_hash; "
            "print(replayed_hash(sys.argv[1], fresh=False))")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, str(root)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert first.startswith("b") and out.stdout.strip().splitlines()[-1] == first
