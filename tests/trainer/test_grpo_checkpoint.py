"""Checkpoints: exact round trip, and a SIGKILLed writer always leaves a complete, consistent checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from intellect_node.errors import IntegrityError
from intellect_node.trainer.checkpoint import TrainerState, latest_dir, load_checkpoint, save_checkpoint
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, make_optimizer, train_step
from tests.support.common import REPO
from tests.support.grpo import tiny_llama
from tests.support.wait import wait_for

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
    import sys, torch
    torch.set_num_threads(1)
    from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from tests.support.grpo import tiny_llama
    root = sys.argv[1]
    m = tiny_llama(hidden=64)
    st = load_checkpoint(root, m)
    v = 0 if st is None else st.version
    while v < 10_000:
        v += 1
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(float(v))          # weights encode the version they belong to
        save_checkpoint(root, m, None, TrainerState(version=v, consumed=frozenset(f"b{i}" for i in range(v)),
                                                     step=v))
""")


def test_sigkill_at_any_moment_leaves_a_consistent_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    last = 0
    for round_ in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(root)], env=env, cwd=REPO)
        try:
            wait_for(lambda: (latest_dir(root) is not None
                              and int(latest_dir(root).name[1:]) >= last + 2), timeout=60,  # type: ignore[union-attr]  # set by now
                     what="the writer to commit two more checkpoints")
            time.sleep(0.01 * round_)  # vary where in the write the kill lands
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        m = tiny_llama(hidden=64)
        st = load_checkpoint(root, m)
        assert st is not None and st.version >= last + 2
        # Weights, version and consumed set were committed together.
        assert all(torch.all(p == float(st.version)) for p in m.parameters())
        assert st.consumed == {f"b{i}" for i in range(st.version)}
        assert json.loads((latest_dir(root) / "state.json").read_text())["version"] == st.version  # type: ignore[operator]  # set by now
        last = st.version


REPLAYER = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from intellect_node.trainer.grpo import GRPOConfig
    from intellect_node.policy.weights import PolicyWeights
    from intellect_node.trainer.step import Sample, make_optimizer, train_step
    from tests.support.grpo import tiny_llama

    root, fresh = Path(sys.argv[1]), sys.argv[2] == "fresh"
    m = tiny_llama(seed=3 if fresh else 9)  # the resumed process starts from other weights
    opt = make_optimizer(m, 1e-2)
    cfg = GRPOConfig(group_size=4, token_budget=16, max_grad_norm=1.0)
    if fresh:
        warm = [Sample((1, 3), (4, 5), (-2.0, -2.5), float(i % 2)) for i in range(4)]
        train_step(m, opt, warm, cfg)  # AdamW has state before the checkpoint
        save_checkpoint(root, m, opt, TrainerState(version=1))
    else:
        assert load_checkpoint(root, m, opt) is not None
    for k in range(3):  # the journaled steps after the checkpoint
        batch = [Sample((1, 2 + k, 3), (4 + i, 5, 6), (-2.0, -2.5 + 0.1 * i, -1.0), float(i % 3 == 0))
                 for i in range(8)]
        train_step(m, opt, batch, cfg)
    print(PolicyWeights.from_state_dict(m.state_dict()).content_hash)
""")


def test_steps_replayed_in_a_new_process_from_a_checkpoint_give_bit_identical_weights(tmp_path: Path) -> None:
    """What a trainer SIGKILLed between checkpoints relies on (``rl.checkpoint_every``,
    roles/trainer/replay.py): the checkpoint's weights and AdamW state plus the same samples in the same order
    reproduce the versions it announced, to the bit, in another process."""
    script = tmp_path / "replayer.py"
    script.write_text(REPLAYER)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def run(mode: str) -> str:
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), mode], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip().splitlines()[-1]

    first = run("fresh")
    assert first.startswith("b") and run("resumed") == first
