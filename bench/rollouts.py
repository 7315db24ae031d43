#!/usr/bin/env python
"""Rollout benchmark: the torch engine against transformers' ``generate`` (and vLLM where it is
installed) on the same model, dtype and prompts, and the cost of proofs and verification as shares of
generation time. One run, one thread.

    .venv/bin/python bench/rollouts.py [--model DIR] [--new-tokens 128] [--repeats 3]
    .venv/bin/python bench/rollouts.py --make-model qwen3-50m --model /tmp/qwen3-50m --new-tokens 256
    .venv-vllm/bin/python bench/rollouts.py --vllm      # adds the vLLM engine (after make test-vllm)

``--make-model FAMILY-SIZE`` writes a random-weight model of a real family into ``--model DIR`` first
when DIR holds none (``intellect_node/testing/models.py``: ``qwen3-50m`` is 55M parameters, byte-level
BPE, ChatML). vLLM is measured when ``--vllm`` is given or vllm is importable; otherwise the output says it
was not.

Times are process CPU time (``time.process_time``), not wall time: the development machine is shared by
several engineers, so wall time mostly measures the neighbours; for single-threaded work CPU time is the
cost. Generation runs past ``<eos>`` (``ignore_eos`` here, ``min_new_tokens`` for transformers) so every row
produces exactly ``--new-tokens`` tokens; the embedded model would otherwise stop after ~5. Figures are the
median of ``--repeats`` runs. Aims: >= 1.5x ``generate`` at batch 32, proofs <= 3% of
generation, verification <= 0.2x generation for 128 new tokens. Verification is timed twice: the tensor
checks on every rollout (full), and ``Verifier.verify`` with the tensor checks on ``--verify-fraction`` of
the rollouts, the cheap checks on all (what a validator with ``rl.verify_fraction`` does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intellect_node.envs.tasks import embedded_task  # noqa: E402
from intellect_node.inference.base import SamplingConfig  # noqa: E402
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts  # noqa: E402
from intellect_node.inference.torch_engine import TorchEngine  # noqa: E402
from intellect_node.inference.verifier import Expectations, Verifier  # noqa: E402
from intellect_node.proofs.thresholds import Thresholds  # noqa: E402
from intellect_node.proofs.toploc import build_proofs_batch  # noqa: E402
from intellect_node.protocol.signing import SigningKey  # noqa: E402

LOOSE = Thresholds(exp_mismatches=2, mant_err_mean=0.5, mant_err_median=1.0, logprob_diff=1e-3,
                   sampling_gap=1e-3)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU seconds of ``fn`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def prompts_for(engine: TorchEngine, batch: int) -> list[list[int]]:
    """16-token prompts like the notes' measurements: a problem's tokens, repeated and cut to 16 (one
    length, so transformers' ``generate`` needs no padding whatever the tokenizer)."""
    problems = embedded_task().sample(random.Random(batch), batch)
    out = []
    for p in problems:
        ids = engine.loaded.tokenizer.prompt_ids(p.prompt)
        out.append((ids * (16 // len(ids) + 1))[:16])
    return out


def hf_generate(model_dir: Path, dtype: str, prompts: list[list[int]], new: int, repeats: int) -> float:
    from transformers import GenerationMixin

    from intellect_node.models.loader import load_hf_model

    hf = load_hf_model(model_dir, dtype=dtype)
    assert isinstance(hf, GenerationMixin)  # a causal LM: generate() is its mixin's
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=True)  # warm-up
        return median_time(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                               max_new_tokens=new, min_new_tokens=new, top_k=0,
                                               pad_token_id=0), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm", action="store_true",
                    help="also measure the vLLM engine (default: when importable)")
    ap.add_argument("--make-model", default=None, metavar="FAMILY-SIZE",
                    help="first write a random-weight model (e.g. qwen3-50m) into --model DIR if it has none")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 (generation and verification)")
    ap.add_argument("--verify-fraction", type=float, default=0.25,
                    help="share of the rollouts given the tensor checks in the second verification timing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.make_model:
        if not args.model:
            ap.error("--make-model needs --model DIR (where the model is written)")
        if not (Path(args.model) / "config.json").exists():
            from intellect_node.testing.models import make_model, parse_spec

            family, size = parse_spec(args.make_model)
            make_model(args.model, family, size)
    engine = TorchEngine.from_dir(args.model, dtype=args.dtype)
    model_dir = engine.loaded.path
    new = args.new_tokens
    cfg = SamplingConfig(max_new_tokens=new, ignore_eos=True)
    from intellect_node.inference.memory import model_shape

    shape = model_shape(model_dir)
    print(f"model {model_dir} ({engine.loaded.config.get('model_type')}, {shape.n_params / 1e6:.1f}M "
          f"parameters, {engine.dtype}), {new} new tokens, 16-token prompts, 1 thread, median CPU time of "
          f"{args.repeats}")
    gen_times: dict[int, float] = {}
    vllm_engine = None
    import importlib.util

    if args.vllm or importlib.util.find_spec("vllm") is not None:
        from intellect_node.inference.vllm_engine import VllmEngine

        vllm_engine = VllmEngine(model_dir, dtype=engine.dtype, max_model_len=16 + new + 8)
    else:
        print("vllm engine: not measured (vllm is not installed in this environment; see make test-vllm)")
    print(f"{'engine':28} {'batch':>5} {'tok/s':>9} {'vs generate':>12}")
    for batch in (1, 32):
        prompts = prompts_for(engine, batch)
        keys = list(range(batch))
        t_hf = hf_generate(model_dir, engine.dtype, prompts, new, args.repeats)
        engine.generate(prompts, keys, SamplingConfig(max_new_tokens=4))  # warm-up
        t_torch = median_time(lambda: engine.generate(prompts, keys, cfg), args.repeats)
        gen_times[batch] = t_torch
        tokens = batch * new
        print(f"{'transformers generate':28} {batch:>5} {tokens / t_hf:>9.0f} {1.0:>11.2f}x")
        print(f"{'torch engine (static cache)':28} {batch:>5} {tokens / t_torch:>9.0f} "
              f"{t_hf / t_torch:>11.2f}x")
        if vllm_engine is not None:
            v = vllm_engine
            v.generate(prompts, keys, SamplingConfig(max_new_tokens=4))
            t_v = median_time(lambda: v.generate(prompts, keys, cfg), args.repeats)
            print(f"{'vllm engine':28} {batch:>5} {tokens / t_v:>9.0f} {t_hf / t_v:>11.2f}x")

    # Proofs and verification for the batch-32 rollouts, as shares of their generation time.
    batch = 32
    problems = embedded_task().sample(random.Random(0), batch)
    gens = engine.generate([engine.loaded.tokenizer.prompt_ids(p.prompt) for p in problems],
                           list(range(batch)), cfg)
    t_proofs = median_time(lambda: build_proofs_batch([g.hidden for g in gens]), args.repeats)
    key = SigningKey(bytes(32))
    recs = generate_rollouts(engine, engine.loaded.tokenizer, problems, key=key, run_id="bench",
                             policy_version=0, checkpoint=checkpoint_cid(model_dir), sampling=cfg,
                             seeds=list(range(batch)))
    verifier = Verifier(engine, LOOSE, Expectations())
    verdicts = verifier.verify_tensors(recs)
    t_verify = median_time(lambda: verifier.verify_tensors(recs), args.repeats)
    checked = set(random.Random(1).sample(range(batch), max(1, round(batch * args.verify_fraction))))
    t_sampled = median_time(lambda: verifier.verify(recs, tensor_checks=checked), args.repeats)
    t_gen = gen_times[32]
    print(f"proof building, batch 32 x {new} tokens: {t_proofs * 1e3:.1f} ms = {t_proofs / t_gen:.3f} of "
          f"generation ({t_gen * 1e3:.0f} ms)")
    print(f"verification (prefill + TOPLOC + logprob + sampler), batch 32: {t_verify * 1e3:.0f} ms = "
          f"{t_verify / t_gen:.3f}x generation; {sum(v.accepted for v in verdicts)}/{batch} accepted")
    print(f"verification with the tensor checks on {len(checked)}/{batch} (verify_fraction "
          f"{args.verify_fraction}): {t_sampled * 1e3:.0f} ms = {t_sampled / t_gen:.3f}x generation")


if __name__ == "__main__":
    main()
