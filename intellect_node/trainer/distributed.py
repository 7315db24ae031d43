"""The GRPO step under torch.distributed, for a trainer launched with ``torchrun``: DDP or FSDP2.

Every rank holds the whole batch's rewards, so advantages are computed on the full groups first; then
rank r takes the samples r, r + W, r + 2W, ... and runs the same micro-steps as the single-process step
(``step.micro_step``). The objective is a sum over tokens divided by a constant budget, so the full
gradient is the *sum* of the ranks' gradients; both wrappers reduce the *mean*, hence each rank scales its
loss by the world size. Then every rank clips to the same global norm and takes the same AdamW step.

- ``ddp``: each rank holds a full replica; gradients are accumulated locally (``no_sync``) and
  all-reduced once, on the last micro-step.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``, per decoder layer and then the root): each
  rank holds 1/W of the parameters, gradients and AdamW state; a layer's weights are all-gathered for
  its forward and backward and its gradients reduce-scattered after each micro-step (not accumulated
  unsharded: that would hold a full gradient per rank, which is what sharding avoids). In bf16 the
  shards stay fp32 master weights and FSDP2's ``MixedPrecisionPolicy`` gathers them as bf16, the same
  scheme as the one-process autocast (``trainer/model.py``); gradients are reduced in fp32.

Every forward and backward holds collectives, so all ranks must run the same number of micro-steps: the
ranks agree on the largest count first, and a rank with fewer runs zero-weighted passes over one of its
samples (loss x 0: the collectives happen, the gradient is unchanged). A batch smaller than the world
therefore still works.

Checkpoints written here are the single-process format (``trainer/checkpoint.py``): the full weights
and the optimizer state keyed by parameter index, gathered to rank 0, so a sharded run resumes in one
process and back.

Teardown: a rank that leaves while gloo's threads or DDP's reducer still hold the process group used to
abort with "terminate called without an active exception" on a loaded machine (the C++ side destroyed
under running threads). :func:`run_ranked` therefore ends in a fixed order: barrier, drop the wrapper (and
its reducer), the optimizer and the model, collect, destroy the group, return.

Run as a module to take one step from a checkpoint on a batch file (what the scale-out tests do)::

    torchrun --nproc_per_node 2 -m intellect_node.trainer.distributed --strategy fsdp \\
        --model-dir M --checkpoint-dir C --batch B.json --out-dir O --lr 1e-3

Shortcuts: the model is loaded whole on every rank before it is sharded (no meta-device init); rank 0
gathers the full weights and optimizer state to write a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from intellect_node.trainer.grpo import GRPOConfig, LossParts
from intellect_node.trainer.step import (
    Sample,
    StepStats,
    batch_advantages,
    micro_batches,
    micro_step,
    summarize,
)

STRATEGIES = ("ddp", "fsdp")


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when not launched under torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wrap(model: Any, strategy: str, *, compute_dtype: torch.dtype | None = None) -> Any:
    """``model`` made data-parallel: a DDP wrapper, or the same module sharded in place by FSDP2."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if strategy != "fsdp":
        raise ValueError(f"strategy {strategy!r} is not one of {STRATEGIES}")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # One FSDP unit per decoder layer (gathered just for its own forward/backward), then the root
    # (embeddings, final norm, LM head).
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _local(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (FSDP2's clip returns one) as a float."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def parallel_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
                        cfg: GRPOConfig, *, strategy: str, micro_batch: int = 64,
                        micro_tokens: int | None = None, pad_id: int = 0, temperature: float = 1.0,
                        compute_dtype: torch.dtype | None = None, lr: float | None = None) -> StepStats:
    """One GRPO step with ``model`` wrapped by :func:`wrap`; every rank passes the whole batch. The
    objective is ``cfg.loss``'s, as in ``step.train_step``; ``lr`` as there (the schedule's)."""
    rank, size = world()
    if len(samples) % cfg.group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {cfg.group_size}")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    adv = batch_advantages(samples, cfg)
    idx = list(range(rank, len(samples), size))
    mine = [samples[i] for i in idx]
    my_adv = adv[idx]
    plan = micro_batches(mine, micro_batch=micro_batch, micro_tokens=micro_tokens) if mine else []
    count = torch.tensor([len(plan)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    steps = int(count[0])
    filler = mine[:1] or list(samples[:1])  # what a rank with fewer micro-steps runs at weight 0
    kw: dict[str, Any] = dict(pad_id=pad_id, loss_scale=float(size), temperature=temperature,
                              compute_dtype=compute_dtype)
    parts: list[LossParts] = []
    for k in range(steps):
        # DDP: accumulate locally, all-reduce on the last backward (every rank runs it). FSDP2 reduces
        # each micro-step's gradients into the shards.
        sync = k == steps - 1 or strategy != "ddp"
        with model.no_sync() if not sync and isinstance(model, DDP) else contextlib.nullcontext():
            if k < len(plan):
                r = plan[k]
                parts.append(micro_step(model, [mine[i] for i in r], my_adv[r.start:r.stop], cfg, **kw))
            else:
                micro_step(model, filler, torch.zeros(1), cfg, **{**kw, "loss_scale": 0.0})
    grad_norm = _local(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    local = summarize(parts, mine, grad_norm)
    # Loss and token counts are per rank; sum them (the per-token means weighted by tokens) so every rank
    # reports the global figures.
    n = float(local.tokens)
    t = torch.tensor([local.loss, n, local.kl_sampler * n, local.neg_logp * n, local.clipped_frac * n],
                     dtype=torch.float64)
    dist.all_reduce(t)
    tokens = max(float(t[1]), 1.0)
    return StepStats(loss=float(t[0]), grad_norm=grad_norm, tokens=int(t[1]), samples=len(samples),
                     clipped_frac=float(t[4]) / tokens, ratio_mean=local.ratio_mean,
                     ratio_max=local.ratio_max,
                     reward_mean=sum(s.reward for s in samples) / len(samples),
                     kl_sampler=float(t[2]) / tokens, neg_logp=float(t[3]) / tokens,
                     lr=float(optimizer.param_groups[0]["lr"]))


# ------------------------------------------------------------------------------ full state on rank 0
def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               strategy: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The full weights (HF names) and the optimizer state in the single-process format (parameters by
    index, in ``named_parameters`` order). Collective for FSDP: every rank calls it; only rank 0's
    result is complete."""
    if strategy == "ddp":
        if not isinstance(model, DDP):
            raise TypeError(f"strategy ddp holds a DistributedDataParallel model, not {type(model).__name__}")
        inner = model.module
        return dict(inner.state_dict()), optimizer.state_dict() if optimizer is not None else None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # A model's state dict holds only tensors (full ones, on the CPU, with these options); torch types
    # it with every value a checkpoint may hold.
    weights = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=opts))
    if optimizer is None:
        return weights, None
    by_name = get_optimizer_state_dict(model, optimizer, options=opts)
    return weights, _by_index(model, by_name)


def _by_index(model: torch.nn.Module, by_name: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name turned into torch's own format (keyed by index)."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    state = {index[name]: v for name, v in by_name.get("state", {}).items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name.get("param_groups", [])]
    return {"state": state, "param_groups": groups}


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, by_index: dict[str, Any],
                   strategy: str) -> None:
    """Load a single-process optimizer state (from ``checkpoint.read_optimizer``) into a wrapped model's
    optimizer; for FSDP every rank takes its shard of it."""
    if strategy == "ddp":
        optimizer.load_state_dict(by_index)
        return
    from torch.distributed.checkpoint.state_dict import (
        OptimizerStateType,
        StateDictOptions,
        set_optimizer_state_dict,
    )

    names = [name for name, _ in model.named_parameters()]
    by_name: OptimizerStateType = {"state": {names[int(i)]: v for i, v in by_index["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                for g in by_index["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))


# ------------------------------------------------------------------------------ batch files
def samples_to_json(samples: Sequence[Sample]) -> str:
    return json.dumps([asdict(s) for s in samples])


def samples_from_json(text: str) -> list[Sample]:
    out = []
    for d in json.loads(text):
        out.append(Sample(prompt_ids=tuple(d["prompt_ids"]), completion_ids=tuple(d["completion_ids"]),
                          old_logprobs=tuple(d["old_logprobs"]), reward=float(d["reward"]),
                          policy_version=int(d["policy_version"]), task_id=str(d["task_id"])))
    return out


# ------------------------------------------------------------------------------ entry point
def run_ranked(body: Callable[[dict[str, object]], None], backend: str) -> None:
    """Run ``body(held)`` inside a process group and tear down in a safe order.

    ``body`` puts what holds the group (the wrapped model, the optimizer) into ``held``; they are
    dropped *before* the group is destroyed, after a barrier that every rank reaches only when all are
    done with collectives, so no gloo or reducer thread is still running when the C++ objects go.
    """
    dist.init_process_group(backend)
    held: dict[str, object] = {}
    ok = False
    try:
        body(held)
        ok = True
    finally:
        if ok:
            dist.barrier()  # every rank has finished its collectives; nobody tears down under another
        held.clear()
        gc.collect()  # the DDP reducer and FSDP hooks hold the group until they are collected
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    from intellect_node.trainer.checkpoint import (
        TrainerState,
        load_checkpoint,
        read_optimizer,
        save_checkpoint_state,
    )
    from intellect_node.trainer.model import TrainOptions, load_trainable
    from intellect_node.trainer.step import make_optimizer

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model-dir", required=True,
                    help="Hugging Face model directory (architecture + weights)")
    ap.add_argument("--checkpoint-dir", help="trainer checkpoint to resume from (weights + optimizer)")
    ap.add_argument("--batch", required=True, help="JSON list of samples (whole groups)")
    ap.add_argument("--out-dir", required=True, help="where rank 0 writes the new checkpoint")
    ap.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: cuda:LOCAL_RANK, nccl")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=64, help="rows per micro-batch at most")
    ap.add_argument("--micro-tokens", type=int, default=None, help="padded tokens per micro-batch at most")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--max-grad-norm", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=1, help="repeat the step on the same batch")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu"
    options = TrainOptions(dtype=args.dtype, device=device,
                           gradient_checkpointing=args.gradient_checkpointing)

    def body(held: dict[str, object]) -> None:
        model = load_trainable(args.model_dir, options)
        state = load_checkpoint(args.checkpoint_dir, model) if args.checkpoint_dir else None
        version = state.version if state else 0
        held["model"] = model = wrap(model, args.strategy, compute_dtype=options.compute_dtype)
        held["opt"] = opt = (make_optimizer(model, args.lr, torch_optim=True) if args.optimizer == "adamw"
                             else torch.optim.SGD(model.parameters(), lr=args.lr))
        if args.checkpoint_dir:
            saved = read_optimizer(args.checkpoint_dir)
            if saved is not None:
                load_optimizer(model, opt, saved, args.strategy)
        cfg = GRPOConfig(group_size=args.group_size, token_budget=args.token_budget,
                         max_grad_norm=args.max_grad_norm)
        samples = samples_from_json(Path(args.batch).read_text())
        stats = [parallel_train_step(model, opt, samples, cfg, strategy=args.strategy,
                                     micro_batch=args.micro_batch, micro_tokens=args.micro_tokens,
                                     compute_dtype=options.compute_dtype)
                 for _ in range(args.steps)]
        weights, opt_state = full_state(model, opt, args.strategy)
        if dist.get_rank() == 0:
            save_checkpoint_state(args.out_dir, weights, opt_state,
                                  TrainerState(version=version + args.steps, step=version + args.steps,
                                               extra={"loss": [s.loss for s in stats],
                                                      "grad_norm": [s.grad_norm for s in stats],
                                                      "world_size": dist.get_world_size(),
                                                      "strategy": args.strategy}))

    run_ranked(body, "nccl" if args.device == "cuda" else "gloo")


if __name__ == "__main__":
    main()
