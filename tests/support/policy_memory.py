"""Peak extra process memory (anonymous RSS) of writing, mapping, checkpointing and delta-coding a
policy of a few hundred MB. Run as a child process (``python -m tests.support.policy_memory DIR``) so the
figures are this work's alone; prints one JSON object of MB per operation.

Anonymous RSS, not total RSS: pages of a mapped file are page cache the kernel can drop, which is the
point of mapping. glibc is told to map (and return) every allocation over 64 KiB, so memory freed by an
earlier operation is not silently reused by a later one.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

TENSORS = 16
NUMEL = 5 * 1024 * 1024  # 20 MiB of fp32 each: 320 MiB in all


def _anon_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_extra_mb(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` while a thread samples anonymous RSS every millisecond; the peak above the start."""
    start = _anon_kb()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], _anon_kb())

    t = threading.Thread(target=sample)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], _anon_kb())
    return (peak[0] - start) / 1024, out


def main(root: Path) -> dict[str, float]:
    from intellect_node.policy.delta import apply_delta, encode_delta
    from intellect_node.policy.weights import PolicyWeights
    from intellect_node.trainer.checkpoint import TrainerState, load_weights, save_checkpoint_state

    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {f"layer{i:02d}.weight": torch.randn(NUMEL) for i in range(TENSORS)}
    out: dict[str, float] = {"model_mb": TENSORS * NUMEL * 4 / 2**20, "tensor_mb": NUMEL * 4 / 2**20}
    out["write"], base = peak_extra_mb(lambda: PolicyWeights.write(root / "v1.safetensors", state))
    out["load_and_hash"], _ = peak_extra_mb(
        lambda: PolicyWeights.load(root / "v1.safetensors", max_size=1 << 40).content_hash)
    out["checkpoint_save"], ck = peak_extra_mb(
        lambda: save_checkpoint_state(root / "ck", state, None, TrainerState(version=1)))
    target = {k: torch.full_like(v, 1.0) for k, v in state.items()}  # pages touched before measuring
    out["checkpoint_load"], _ = peak_extra_mb(
        lambda: load_weights(ck / "model.safetensors",
                             SimpleNamespace(state_dict=lambda: target)))  # type: ignore[arg-type]  # it only calls state_dict()
    assert all(torch.equal(target[k], v) for k, v in state.items())
    for v in state.values():  # an RL-sized update: a few ulps on every element
        v.mul_(1 + 1e-6)
    nxt = PolicyWeights.write(root / "v2.safetensors", state)
    state.clear()  # the model is on disk now; what follows reads the files
    target.clear()
    out["encode_delta"], delta = peak_extra_mb(lambda: encode_delta(base, nxt))
    out["delta_mb"] = len(delta) / 2**20
    out["apply_delta_to_file"], got = peak_extra_mb(
        lambda: apply_delta(base, delta, expected_hash=nxt.content_hash, max_size=1 << 40,
                            path=root / "v2-applied.safetensors"))
    assert got.content_hash == nxt.content_hash
    # The meter sees a copy: the in-memory canonical bytes of the whole model, still held when the
    # meter takes its last sample (the sampling thread may not get the GIL while a C copy runs, so a copy
    # made and freed inside one call can fall between samples).
    out["in_memory_copy"], held = peak_extra_mb(
        lambda: PolicyWeights.parse(memoryview(nxt.to_bytes()), max_size=1 << 40))
    del held
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
