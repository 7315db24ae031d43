"""The GRPO step under torch.distributed (DDP), for a trainer launched with ``torchrun``.

Every rank holds the whole batch's rewards, so advantages are computed on the full groups first; then
rank r takes the samples r, r + W, r + 2W, ... and runs the same micro-batched forward/backward as the
single-process step. The objective is a sum over tokens divided by a constant budget, so the full
gradient is the *sum* of the ranks' gradients; DDP all-reduces the *mean*, hence each rank scales its
loss by the world size. After the all-reduce every rank holds the same gradient, clips it to the same
global norm and takes the same AdamW step, so the weights stay identical without a broadcast.

Run as a module to take one step from a checkpoint on a batch file (what the scale-out test does)::

    torchrun --nproc_per_node 2 -m intellect_node.trainer.distributed \\
        --model-dir M --checkpoint-dir C --batch B.json --out-dir O --lr 1e-3

Shortcuts: DDP only (each rank holds a full replica; FSDP would shard it, which a model of this size does
not need); gloo on CPU; rank 0 alone writes the checkpoint.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.step import Sample, StepStats, accumulate_gradients, batch_advantages, summarize


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when not launched under torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def ddp_train_step(ddp_model: Any, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
                   cfg: GRPOConfig, *, micro_batch: int = 64, pad_id: int = 0) -> StepStats:
    """One GRPO step with ``ddp_model`` (a DistributedDataParallel); every rank passes the whole batch."""
    rank, size = world()
    if len(samples) % cfg.group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {cfg.group_size}")
    ddp_model.train()
    optimizer.zero_grad(set_to_none=True)
    adv = batch_advantages(samples, cfg)
    idx = list(range(rank, len(samples), size))
    mine = [samples[i] for i in idx]
    my_adv = adv[idx]
    if not mine:
        raise ValueError(f"rank {rank} got no samples: batch of {len(samples)} < world size {size}")
    # DDP all-reduces gradients on each backward; accumulate locally and reduce once at the end.
    with ddp_model.no_sync():
        parts = accumulate_gradients(ddp_model, mine[:-1], my_adv[:-1], cfg,
                                     micro_batch=micro_batch, pad_id=pad_id, loss_scale=float(size))
    # The last sample's backward runs outside no_sync and triggers the all-reduce of the accumulated
    # gradients (every rank must call it, so every rank needs at least one sample).
    parts += accumulate_gradients(ddp_model, mine[-1:], my_adv[-1:], cfg, micro_batch=micro_batch,
                                  pad_id=pad_id, loss_scale=float(size))
    grad_norm = float(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    local = summarize(parts, mine, grad_norm)
    # Loss and token counts are per rank; sum them so every rank reports the global figures.
    t = torch.tensor([local.loss, float(local.tokens)], dtype=torch.float64)
    dist.all_reduce(t)
    return StepStats(loss=float(t[0]), grad_norm=grad_norm, tokens=int(t[1]), samples=len(samples),
                     clipped_frac=local.clipped_frac, ratio_mean=local.ratio_mean, ratio_max=local.ratio_max,
                     reward_mean=sum(s.reward for s in samples) / len(samples))


def samples_to_json(samples: Sequence[Sample]) -> str:
    return json.dumps([asdict(s) for s in samples])


def samples_from_json(text: str) -> list[Sample]:
    out = []
    for d in json.loads(text):
        out.append(Sample(prompt_ids=tuple(d["prompt_ids"]), completion_ids=tuple(d["completion_ids"]),
                          old_logprobs=tuple(d["old_logprobs"]), reward=float(d["reward"]),
                          policy_version=int(d["policy_version"]), task_id=str(d["task_id"])))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from intellect_node.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from intellect_node.trainer.step import make_optimizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True,
                    help="Hugging Face model directory (architecture + weights)")
    ap.add_argument("--checkpoint-dir", help="trainer checkpoint to resume from (weights + optimizer)")
    ap.add_argument("--batch", required=True, help="JSON list of samples (whole groups)")
    ap.add_argument("--out-dir", required=True, help="where rank 0 writes the new checkpoint")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--max-grad-norm", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=1, help="repeat the step on the same batch")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        opt = (make_optimizer(model, args.lr) if args.optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=args.lr))
        state = load_checkpoint(args.checkpoint_dir, model, opt) if args.checkpoint_dir else None
        version = state.version if state else 0
        ddp = DistributedDataParallel(model)
        cfg = GRPOConfig(group_size=args.group_size, token_budget=args.token_budget,
                         max_grad_norm=args.max_grad_norm)
        samples = samples_from_json(Path(args.batch).read_text())
        stats = [ddp_train_step(ddp, opt, samples, cfg) for _ in range(args.steps)]
        if dist.get_rank() == 0:
            save_checkpoint(args.out_dir, model, opt,
                            TrainerState(version=version + args.steps, step=version + args.steps,
                                         extra={"loss": [s.loss for s in stats],
                                                "world_size": dist.get_world_size()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
