#!/usr/bin/env python
"""Bytes on the wire per policy update, delta vs full checkpoint, and the time for 4 peers to hold a
new version over loopback HTTP, delta vs full.

    .venv/bin/python bench/delta.py [--model DIR] [--steps 4] [--layers 8] [--peers 4] [--skip-synthetic]

1. The embedded model (``intellect_node/assets/model`` or ``--model``) trained by real GRPO steps
   (``trainer.step.train_step``: sampled groups on the addition task, AdamW) at the swarm's learning
   rate (``[rl] lr``) and at 3e-5; the policy is published in fp32 and in bf16 (fp32 master weights
   cast down).
2. A synthetic Llama-shaped model of >= 100M parameters (vocab 32000, hidden 768, ``--layers``) updated by
   AdamW at lr 3e-7 (INTELLECT-2) and 3e-5 with random N(0, 1e-3) gradients (AdamW normalises them,
   so each element moves by about the learning rate, as with real gradients), bf16 and fp32.
3. A trainer and ``--peers`` followers in this process, each with its own blob store and HTTP server on
   127.0.0.1, every follower holding version v-1: the time from the announcement of v until all hold
   v (fetched, applied, hash-checked, persisted), by delta (default encodings, or with ``add_by_exp``)
   and by the full checkpoint; once on bare loopback and once with each follower's downlink emulated
   at ``--link-mbit`` (chunks are handed over no earlier than such a link would deliver them).

Every figure is printed beside the full-checkpoint baseline measured in the same run, as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from intellect_node.policy.delta import (  # noqa: E402
    ALL_DENSE_KINDS,
    DENSE_KINDS,
    apply_delta,
    delta_stats,
    encode_delta,
)
from intellect_node.policy.weights import PolicyWeights  # noqa: E402

LIMIT = 1 << 40


def measure(prev: PolicyWeights, cur: PolicyWeights) -> dict[str, Any]:
    t0 = time.perf_counter()
    delta = encode_delta(prev, cur)
    t1 = time.perf_counter()
    out = apply_delta(prev, delta, expected_hash=cur.content_hash, max_size=LIMIT)
    t2 = time.perf_counter()
    assert bytes(out.to_bytes()) == bytes(cur.to_bytes())
    with_exp = encode_delta(prev, cur, dense=ALL_DENSE_KINDS)  # the opt-in add_by_exp as well
    t3 = time.perf_counter()
    assert apply_delta(prev, with_exp, expected_hash=cur.content_hash, max_size=LIMIT).content_hash == \
        cur.content_hash
    t4 = time.perf_counter()
    changed = total = 0
    for name in cur.tensors:
        a, b = prev.bits(name), cur.bits(name)
        changed += int((a != b).sum())
        total += a.size
    return {"full": cur.nbytes, "delta": len(delta), "encode_s": t1 - t0, "apply_s": t2 - t1,
            "exp": len(with_exp), "exp_apply_s": t4 - t3,
            "changed": changed / total, "kinds": delta_stats(delta, max_size=LIMIT)}


def report(label: str, rows: list[dict[str, Any]]) -> None:
    full = sum(r["full"] for r in rows) / len(rows)
    delta = sum(r["delta"] for r in rows) / len(rows)
    kinds: dict[str, int] = {}
    for r in rows:
        for k, v in r["kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    top = ", ".join(f"{k} {v / max(1, sum(kinds.values())):.0%}" for k, v in kinds.items() if v)
    print(f"  {label:<28} full {full / 1e6:9.2f} MB  delta {delta / 1e6:9.3f} MB  ratio {delta / full:6.3f}"
          f"  changed {sum(r['changed'] for r in rows) / len(rows):6.1%}"
          f"  encode {max(r['encode_s'] for r in rows):6.2f} s"
          f"  apply {max(r['apply_s'] for r in rows):6.2f} s  [{top}]", flush=True)
    exp = sum(r["exp"] for r in rows) / len(rows)
    print(f"  {'':<28} with add_by_exp: delta {exp / 1e6:9.3f} MB  ratio {exp / full:6.3f}"
          f"  apply {max(r['exp_apply_s'] for r in rows):6.2f} s", flush=True)


# ------------------------------------------------------------------------------------ embedded model
def grpo_updates(model_dir: str | None, steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    from intellect_node.envs.tasks import embedded_task
    from intellect_node.models.loader import ModelTokenizer, load_hf_model, resolve_model_dir
    from intellect_node.trainer.grpo import GRPOConfig
    from intellect_node.trainer.step import Sample, make_optimizer, train_step

    path = resolve_model_dir(model_dir)
    model = load_hf_model(path, "float32")
    tok = ModelTokenizer(path)
    task, rng, gen = embedded_task(), random.Random(0), torch.Generator().manual_seed(0)
    cfg = GRPOConfig()
    opt = make_optimizer(model, lr)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for step in range(steps):
        problems = task.sample(rng, 8)
        samples = []
        with torch.no_grad():
            model.train(False)  # eval mode (transformers leaves eval() untyped)
            for p in problems:
                prompt = tok.prompt_ids(p.prompt)
                ids = torch.tensor([prompt] * cfg.group_size)
                lps: list[list[float]] = [[] for _ in range(cfg.group_size)]
                for _ in range(len(p.answer) + 1):
                    logp = torch.log_softmax(model(input_ids=ids).logits[:, -1, :].float(), -1)
                    nxt = torch.multinomial(logp.exp(), 1, generator=gen)
                    for i in range(cfg.group_size):
                        lps[i].append(float(logp[i, nxt[i, 0]]))
                    ids = torch.cat([ids, nxt], 1)
                for i in range(cfg.group_size):
                    comp = ids[i, len(prompt):].tolist()
                    samples.append(Sample(tuple(prompt), tuple(comp), tuple(lps[i]),
                                          p.reward(tok.decode(comp)), policy_version=step))
        st = train_step(model, opt, samples, cfg, pad_id=tok.pad_id)
        print(f"    GRPO step {step}: reward {st.reward_mean:.3f} loss {st.loss:+.4f} "
              f"grad_norm {st.grad_norm:.3f}", flush=True)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def embedded_section(args: argparse.Namespace) -> None:
    for lr in args.lr:
        print(f"\n== embedded model, {args.steps} GRPO steps at lr {lr:g} ==", flush=True)
        try:
            states = grpo_updates(args.model, args.steps, lr)
        except Exception as exc:  # the bench reports what it could not run and carries on
            print(f"  skipped: {exc}")
            return
        n = sum(v.numel() for v in states[0].values())
        print(f"  {n / 1e6:.2f}M parameters")
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            ck = [PolicyWeights.from_state_dict({k: v.to(dtype) for k, v in s.items()}) for s in states]
            report(f"embedded {name} lr {lr:g}", [measure(a, b) for a, b in zip(ck, ck[1:])])


# ------------------------------------------------------------------------------------ synthetic model
def synthetic_params(layers: int, hidden: int = 768, inter: int = 2048,
                     vocab: int = 32000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.02)

    p: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(vocab, hidden),
                                  "lm_head.weight": w(vocab, hidden),
                                  "model.norm.weight": torch.nn.Parameter(torch.ones(hidden))}
    for i in range(layers):
        pre = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            p[pre + f"self_attn.{n}.weight"] = w(hidden, hidden)
        p[pre + "mlp.gate_proj.weight"] = w(inter, hidden)
        p[pre + "mlp.up_proj.weight"] = w(inter, hidden)
        p[pre + "mlp.down_proj.weight"] = w(hidden, inter)
        p[pre + "input_layernorm.weight"] = torch.nn.Parameter(torch.ones(hidden))
        p[pre + "post_attention_layernorm.weight"] = torch.nn.Parameter(torch.ones(hidden))
    return p


def synthetic_section(args: argparse.Namespace) -> tuple[PolicyWeights, PolicyWeights] | None:
    keep: tuple[PolicyWeights, PolicyWeights] | None = None
    for lr in ((3e-5,) if args.only_peers else (3e-7, 3e-5)):
        params = synthetic_params(args.layers)
        n = sum(v.numel() for v in params.values())
        print(f"\n== synthetic {n / 1e6:.1f}M-parameter model, AdamW lr {lr:g}, "
              f"{args.synthetic_steps} steps ==", flush=True)
        # foreach=False: one tensor at a time keeps the optimizer's temporaries small (memory is shared).
        opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.01, foreach=False)
        g = torch.Generator().manual_seed(1)
        rows: dict[str, list[dict[str, Any]]] = {"fp32": [], "bf16": []}
        prev: dict[str, PolicyWeights] = {}
        for step in range(args.synthetic_steps + 1):
            if step:
                for p in params.values():
                    p.grad = torch.randn(p.shape, generator=g) * 1e-3
                opt.step()
                opt.zero_grad(set_to_none=True)
            for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                if args.only_peers and name == "fp32":
                    continue
                with torch.no_grad():
                    cur = PolicyWeights.from_state_dict({k: v.detach().to(dtype) for k, v in params.items()})
                if name in prev:
                    rows[name].append(measure(prev[name], cur))
                    if name == "bf16" and lr == 3e-5 and step == args.synthetic_steps:
                        keep = (prev[name], cur)
                prev[name] = cur
                gc.collect()
        for name in ("bf16", "fp32"):
            if rows[name]:
                report(f"synthetic {name} lr {lr:g}", rows[name])
        del params, opt, prev, rows
        gc.collect()
    return keep


# ------------------------------------------------------------------------------------ peers on loopback
def link_limited(rate: float) -> Any:
    """An HTTP chunk source behind an emulated downlink of ``rate`` bytes/s: each chunk is handed over no
    earlier than the link could have delivered it after the chunks before it."""
    from intellect_node.blobs.http import HttpChunkSource

    class LinkLimitedSource(HttpChunkSource):
        def __init__(self) -> None:
            super().__init__()
            self._free_at = 0.0

        async def read_chunk(self, provider: object, cid: str, length: int, sink: Any, *,
                             if_idle: bool = True) -> None:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + length / rate
            held = _Buffer()
            await super().read_chunk(provider, cid, length, held, if_idle=if_idle)
            delay = self._free_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sink.write(held.data)

    return LinkLimitedSource()


class _Buffer:
    """A chunk sink that keeps the bytes (the source's pieces are views of a reused buffer)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        self.data += piece


async def peers_section(pair: tuple[PolicyWeights, PolicyWeights], n_peers: int, label: str,
                        link_mbit: float | None) -> None:
    import msgspec

    from intellect_node.blobs.peer import BlobPeer, mesh
    from intellect_node.protocol.policy import open_announcement, seal_announcement
    from intellect_node.roles.common.policy import PolicyFollower, PolicyPublisher

    prev, cur = pair
    link = (f"each peer's downlink emulated at {link_mbit:g} Mbit/s" if link_mbit
            else "loopback, no link limit")
    print(f"\n== {n_peers} peers on 127.0.0.1 obtain the next version of {label} "
          f"({cur.nbytes / 1e6:.1f} MB), each holding the previous one; {link} ==", flush=True)
    rate = link_mbit * 1e6 / 8 if link_mbit else None
    tmp = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    try:
        results: dict[str, float] = {}
        # "delta": the default encodings; "delta-exp": with the opt-in add_by_exp (fewer bytes, more CPU).
        for mode, kinds in (("delta", DENSE_KINDS), ("delta-exp", ALL_DENSE_KINDS), ("full", DENSE_KINDS)):
            root = tmp / mode
            slow = [[link_limited(rate)] if rate and i else [] for i in range(n_peers + 1)]
            peers = [await BlobPeer(root / f"blobs{i}", extra_sources=slow[i]).start()
                     for i in range(n_peers + 1)]
            mesh(peers)
            trainer, followers = peers[0], peers[1:]
            try:
                pub = PolicyPublisher(root / "pub", trainer.blobs, trainer.key, "bench", full_every=64,
                                      dense_kinds=kinds)
                await pub.publish(0, prev)
                ann, raw = await pub.publish(1, cur)
                if mode == "full":  # what systems without deltas send: the whole checkpoint each time
                    full_path = root / "full.safetensors"
                    cur.save(full_path)
                    cid, m = await trainer.blobs.put_file(full_path)
                    ann = msgspec.structs.replace(ann, full_version=1, full_cid=cid, full_size=m.total_size,
                                                  deltas=[])
                    raw = seal_announcement(trainer.key, ann)
                fols = []
                for i, p in enumerate(followers):
                    f = PolicyFollower(root / f"fol{i}", p.blobs, run_id="bench", trainer=trainer.key.peer_id,
                                       max_checkpoint_bytes=LIMIT)
                    f.version, f.checkpoint = 0, prev
                    fols.append(f)
                t0 = time.perf_counter()
                got = await asyncio.gather(*(f.obtain(open_announcement(raw, run_id="bench",
                                                                        trainer=trainer.key.peer_id))
                                             for f in fols))
                dt = time.perf_counter() - t0
                assert all(g.checkpoint.content_hash == cur.content_hash for g in got)
                assert all(g.path == mode.split("-")[0] for g in got), [g.path for g in got]
                moved = sum(g.bytes_fetched for g in got)
                results[mode] = dt
                results[f"{mode}_bytes"] = moved
                print(f"  {mode:<10}: all {n_peers} hold v1 after {dt:6.2f} s; "
                      f"{moved / 1e6:9.2f} MB fetched in all", flush=True)
            finally:
                for p in peers:
                    await p.stop()
        print(f"  time ratio to full: delta {results['delta'] / results['full']:.3f}, delta-exp "
              f"{results['delta-exp'] / results['full']:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps on the embedded model")
    from intellect_node.config import RLConfig

    ap.add_argument("--lr", type=float, nargs="+", default=[RLConfig().lr, 3e-5],
                    help="learning rates of the embedded model's GRPO steps "
                         "(default: the swarm's [rl] lr, 3e-5)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the synthetic model (8: 106M params)")
    ap.add_argument("--synthetic-steps", type=int, default=2)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--link-mbit", type=float, default=1000.0,
                    help="emulated downlink of each peer for the second timing run (Mbit/s)")
    ap.add_argument("--only-peers", action="store_true", help="skip the embedded section and the fp32 runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
          "(other processes share the cores: times scale with it, byte counts do not)")
    if not args.only_peers:
        embedded_section(args)
    if args.skip_synthetic:
        return
    pair = synthetic_section(args)
    if pair is not None:
        for mbit in (None, args.link_mbit):
            asyncio.run(peers_section(pair, args.peers, "the synthetic bf16 model at lr 3e-5", mbit))
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
