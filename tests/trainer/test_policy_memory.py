"""A policy of 320 MiB (16 tensors of 20 MiB) is written, hashed, checkpointed, loaded back and delta-coded
without a second copy of the model in process memory: each step's peak extra anonymous memory is bounded
by a few tensors, while the meter does see a whole-model copy where one is made (the in-memory parse)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import REPO

pytestmark = pytest.mark.slow  # 320 MiB written and fsynced four times


def test_publication_paths_hold_at_most_a_few_tensors_extra(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="65536")
    r = subprocess.run([sys.executable, "-m", "tests.support.policy_memory", str(tmp_path)], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    mb = json.loads(r.stdout.strip().splitlines()[-1])
    tensor, model = mb["tensor_mb"], mb["model_mb"]
    assert mb["in_memory_copy"] > 0.9 * model, mb  # the meter sees a copy when there is one
    for streamed in ("write", "load_and_hash", "checkpoint_save"):
        assert mb[streamed] < 8, (streamed, mb)
    assert mb["checkpoint_load"] < tensor + 8, mb  # one tensor read at a time
    # Per tensor: the XOR, the differences, their byte planes and the compressed frame.
    assert mb["encode_delta"] < 6 * tensor, mb
    assert mb["apply_delta_to_file"] < 4 * tensor, mb
