#!/usr/bin/env python
"""GPU check (``make test-gpu``): what a CUDA machine must do for a node, in one command, one summary.

On a tiny random-weight model of a real family (built here with transformers' configs, nothing
downloaded), on the CUDA device:

1. the torch engine generates rollouts (throughput: new tokens per second);
2. the vLLM engine generates rollouts with the seeded sampler and hidden states (throughput);
3. calibration of each engine pair against the torch verifier on the same device;
4. cross-engine proofs: vLLM's honest rollouts are accepted by the torch verifier under the run's
   thresholds (``run.rollout_engines = ["vllm@cuda"]``), a token edited and re-signed by the worker is
   rejected, and rollouts of other weights are rejected;
5. one trainer step on CUDA (bf16 compute over fp32 master weights), loss finite and weights moved.

Every step runs even if one before failed (where it can); the summary lists each with its figures and
the exit code is 1 if any failed. Without CUDA it says so and exits 1, or 0 with ``--allow-no-gpu``.
``--device cpu --skip-vllm`` runs the same steps on the CPU (what the CPU test suite does to keep this
script working between GPU runs).

    .venv/bin/python scripts/gpu-check.py [--family qwen3] [--allow-no-gpu] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NO_GPU_EXIT = 1


@dataclass
class Step:
    name: str
    ok: bool
    detail: str
    seconds: float


class Report:
    def __init__(self) -> None:
        self.steps: list[Step] = []

    def run(self, name: str, fn: Callable[[], str]) -> bool:
        t0 = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # a step's failure is reported and the next step still runs
            detail, ok = f"{type(exc).__name__}: {exc}", False
            traceback.print_exc(file=sys.stderr)
        self.steps.append(Step(name, ok, detail, time.perf_counter() - t0))
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        return ok

    def summary(self, header: str) -> int:
        print(f"\n== gpu-check summary: {header}")
        width = max(len(s.name) for s in self.steps)
        for s in self.steps:
            print(f"  {'ok  ' if s.ok else 'FAIL'} {s.name:<{width}} {s.seconds:7.1f}s  {s.detail}")
        failed = [s.name for s in self.steps if not s.ok]
        print(f"== {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
        return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from intellect_node.testing.models import FAMILIES

    ap = argparse.ArgumentParser(description="Check vLLM and torch engines, cross-engine proofs and a "
                                 "trainer step on a CUDA device; prints one summary.")
    ap.add_argument("--family", choices=FAMILIES, default="qwen3", help="model family of the tiny model")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N (or cpu, to exercise the script)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="inference dtype of both engines and the verifier")
    ap.add_argument("--rollouts", type=int, default=32, help="honest rollouts per engine")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--allow-no-gpu", action="store_true", help="exit 0 on a machine without CUDA")
    ap.add_argument("--skip-vllm", action="store_true", help="leave out the vLLM steps")
    return ap.parse_args(argv)


def no_gpu_message() -> str:
    import torch

    return (f"no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
            "nothing was checked. Run `make test-gpu` on a machine with an NVIDIA GPU and a CUDA build of "
            "torch (and vllm).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu-check: {no_gpu_message()}")
        return 0 if args.allow_no_gpu else NO_GPU_EXIT
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        return Checks(args, Path(tmp)).run_all()


class Checks:
    """The steps, sharing the model folder, engines and rollouts they build."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args, self.root = args, root
        self.report = Report()
        self.engines: dict[str, Any] = {}
        self.records: dict[str, list[Any]] = {}

    def run_all(self) -> int:
        import torch

        a = self.args
        name = torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else "CPU"
        r = self.report
        r.run("build model", self.build_model)
        r.run("torch engine", lambda: self.generate("torch"))
        if not a.skip_vllm:
            r.run("vLLM engine", lambda: self.generate("vllm"))
        r.run("calibrate pairs", self.calibrate)
        r.run("torch rollouts verify", lambda: self.verify_honest("torch"))
        if not a.skip_vllm:
            r.run("vLLM rollouts verify (torch verifier)", lambda: self.verify_honest("vllm"))
        source = "torch" if a.skip_vllm else "vllm"
        r.run(f"tampered {source} rollout rejected", lambda: self.verify_tampered(source))
        r.run(f"other weights' {source} rollouts rejected", lambda: self.verify_other_weights(source))
        r.run("trainer step", self.trainer_step)
        return r.summary(f"{a.family} on {a.device} ({name}), {a.dtype}")

    # -- steps ---------------------------------------------------------------------------------------

    def build_model(self) -> str:
        from intellect_node.inference.memory import model_shape
        from intellect_node.testing.models import make_model

        self.model = make_model(self.root / "model", self.args.family)
        self.other = make_model(self.root / "other", self.args.family, seed=1)
        return f"{model_shape(self.model).n_params / 1e6:.2f}M parameters"

    def _problems(self, n: int, seed: int) -> list[Any]:
        from intellect_node.envs.tasks import embedded_task

        return embedded_task().sample(random.Random(seed), n)

    def _engine(self, kind: str) -> Any:
        from intellect_node.inference import make_engine

        if kind not in self.engines:
            vllm = {"max_model_len": 512, "max_num_seqs": 64, "gpu_memory_fraction": 0.3}
            self.engines[kind] = make_engine(self.model, kind, dtype=self.args.dtype, device=self.args.device,
                                             vllm=vllm if kind == "vllm" else None)
        return self.engines[kind]

    def _rollouts(self, engine: Any, problems: list[Any], seeds: list[int]) -> list[Any]:
        from intellect_node.inference import SamplingConfig
        from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
        from intellect_node.protocol.signing import SigningKey

        return generate_rollouts(engine, self._verifier_engine().loaded.tokenizer, problems,
                                 key=SigningKey(bytes(32)), run_id="gpu-check", policy_version=0,
                                 checkpoint=checkpoint_cid(self.model),
                                 sampling=SamplingConfig(max_new_tokens=self.args.new_tokens), seeds=seeds)

    def _verifier_engine(self) -> Any:
        return self._engine("torch")

    def generate(self, kind: str) -> str:
        from intellect_node.inference import SamplingConfig

        engine = self._engine(kind)
        n, new = self.args.rollouts, self.args.new_tokens
        tok = self._verifier_engine().loaded.tokenizer
        prompts = [tok.prompt_ids(p.prompt) for p in self._problems(n, 7)]
        engine.generate(prompts[:2], [0, 1], SamplingConfig(max_new_tokens=4))  # warm-up
        self._sync()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, list(range(n)), SamplingConfig(max_new_tokens=new, ignore_eos=True))
        self._sync()
        dt = time.perf_counter() - t0
        if any(len(g.tokens) != new or g.hidden.shape[0] != new for g in gens):
            raise AssertionError("a row has fewer tokens or hidden states than asked for")
        self.records[kind] = self._rollouts(engine, self._problems(n, 11), list(range(100, 100 + n)))
        return f"{n} x {new} tokens in {dt:.2f}s = {n * new / dt:,.0f} tok/s (batch {n})"

    def _sync(self) -> None:
        import torch

        if self.args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def calibrate(self) -> str:
        import json

        from intellect_node.fsutil import atomic_write_text
        from intellect_node.inference import SamplingConfig
        from intellect_node.inference.calibrate import calibrate
        from intellect_node.proofs.thresholds import merge_into

        sources = [self._engine(k) for k in ("torch", "vllm") if k in self.engines]
        cals = calibrate(self._verifier_engine(), sources, n=16, batch_sizes=(1, 8),
                         sampling=SamplingConfig(max_new_tokens=self.args.new_tokens))
        self.thresholds_file = self.root / "proof_thresholds.json"
        for cal in cals:
            atomic_write_text(self.thresholds_file, json.dumps(merge_into(self.thresholds_file, cal)))
        return "; ".join(f"{c.key}: exp<={c.thresholds.exp_mismatches}, "
                         f"mean<={c.thresholds.mant_err_mean:.3g}" for c in cals)

    def _verifier(self, kind: str, engine: Any | None = None) -> Any:
        from intellect_node.inference.rollouts import checkpoint_cid
        from intellect_node.inference.verifier import Expectations, Verifier
        from intellect_node.proofs.thresholds import load_thresholds

        th = load_thresholds(self.model, self.args.dtype, self.thresholds_file,
                             generators=[f"{kind}@{self.args.device}"], verify_device=self.args.device)
        return Verifier(engine or self._verifier_engine(), th,
                        Expectations(run_id="gpu-check", checkpoint_cid=checkpoint_cid(self.model)))

    def verify_honest(self, kind: str) -> str:
        verdicts = self._verifier(kind).verify(self.records[kind])
        bad = [v for v in verdicts if not v.accepted]
        if bad:
            raise AssertionError(f"{len(bad)}/{len(verdicts)} honest rollouts rejected, e.g. {bad[0].reason} "
                                 f"{bad[0].detail}")
        worst = max(v.figures.get("exp_mismatches", 0) for v in verdicts)
        return f"{len(verdicts)}/{len(verdicts)} accepted (worst exponent mismatches {worst:.0f})"

    def verify_tampered(self, kind: str) -> str:
        import msgspec

        from intellect_node.protocol.rollout import sign_rollout
        from intellect_node.protocol.signing import SigningKey

        forged = []
        for rec in self.records[kind][:8]:
            tokens = list(rec.completion_tokens)
            i = len(tokens) // 2
            tokens[i] = 3 + (tokens[i] + 7) % 300
            forged.append(sign_rollout(msgspec.structs.replace(rec, completion_tokens=tokens),
                                       SigningKey(bytes(32))))
        verdicts = self._verifier(kind).verify(forged)
        passed = [v for v in verdicts if v.accepted]
        if passed:
            raise AssertionError(f"{len(passed)}/{len(verdicts)} rollouts with an edited token were accepted")
        reasons = ", ".join(sorted({str(v.reason) for v in verdicts}))
        return f"{len(verdicts)}/{len(verdicts)} rejected ({reasons})"

    def verify_other_weights(self, kind: str) -> str:
        from intellect_node.inference import make_engine

        other = make_engine(self.other, "torch", dtype=self.args.dtype, device=self.args.device)
        recs = self._rollouts(other, self._problems(8, 13), list(range(200, 208)))
        verdicts = self._verifier(kind).verify(recs)
        passed = [v for v in verdicts if v.accepted]
        if passed:
            raise AssertionError(f"{len(passed)}/{len(verdicts)} rollouts of other weights were accepted")
        return f"{len(verdicts)}/{len(verdicts)} rejected"

    def trainer_step(self) -> str:
        import torch

        from intellect_node.roles.common.records import record_to_sample
        from intellect_node.trainer.grpo import GRPOConfig
        from intellect_node.trainer.model import TrainOptions, load_trainable
        from intellect_node.trainer.step import make_optimizer, train_step

        device = self.args.device if ":" in self.args.device or self.args.device == "cpu" else "cuda:0"
        opts = TrainOptions(dtype="bfloat16", device=device)
        model = load_trainable(self.model, opts)
        opt = make_optimizer(model, 1e-3)
        recs = self.records.get("vllm") or self.records["torch"]
        samples = [record_to_sample(r, float(i % 2)) for i, r in enumerate(recs[:8])]
        before = [p.detach().clone() for p in model.parameters()]
        self._sync()
        t0 = time.perf_counter()
        stats = train_step(model, opt, samples, GRPOConfig(group_size=4), compute_dtype=opts.compute_dtype)
        self._sync()
        dt = time.perf_counter() - t0
        moved = sum(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
        if not moved or not all(torch.isfinite(p).all() for p in model.parameters()):
            raise AssertionError(f"the step left {moved} tensors changed, or non-finite weights")
        return (f"{len(samples)} samples in {dt:.2f}s, loss {stats.loss:.4g}, "
                f"grad norm {stats.grad_norm:.3g}, {moved} tensors updated")


if __name__ == "__main__":
    sys.exit(main())
