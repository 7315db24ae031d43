"""Calibrate the validator's thresholds from honest rollouts (``intellect-node proofs calibrate``).

Honest rollouts of the embedded task are generated at each batch size (batch composition changes the
kernels' shapes and so the last bits), verified by batched prefill in the validator's own grouping, and
the worst figure of each check is kept; thresholds add the margins of :class:`Margins`. Every engine
given (torch, vLLM, on its own device) is a source of honest rollouts verified against the same prefill,
and each gives its own :class:`Calibration`: one engine pair (``proofs/thresholds.py``), so that a run
admitting only torch workers is not loosened by vLLM's noise.

Shortcut: the problems default to the embedded addition task; a real model's calibration should pass
its run's problems (the prompts' lengths and the completions' shapes matter more than their content).
"""

from __future__ import annotations

import json
import random
from typing import Sequence

from intellect_node.envs.tasks import Problem, embedded_task
from intellect_node.inference.base import InferenceEngine, SamplingConfig
from intellect_node.inference.rollouts import generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.proofs.thresholds import (
    Calibration,
    Margins,
    Observed,
    Thresholds,
    device_kind,
    model_fingerprint,
)
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey

_UNBOUNDED = Thresholds(exp_mismatches=10 ** 9, mant_err_mean=float("inf"), mant_err_median=float("inf"),
                        logprob_diff=float("inf"), sampling_gap=float("inf"))
_CAL_CID = cid_of(b"intellect-node calibration")  # a well-formed CID; calibration does not check it


def calibrate(verifier_engine: TorchEngine, engines: Sequence[InferenceEngine] = (), *, n: int = 64,
              batch_sizes: Sequence[int] = (1, 32), sampling: SamplingConfig = SamplingConfig(),
              seed: int = 0, margins: Margins = Margins(),
              problems: Sequence[Problem] | None = None) -> list[Calibration]:
    """Per engine (its pair with the verifier), the worst honest figures over ``n`` rollouts per batch
    size, and thresholds with margins."""
    engines = list(engines) or [verifier_engine]
    tok = verifier_engine.loaded.tokenizer
    key = SigningKey(bytes(32))
    verifier = Verifier(verifier_engine, _UNBOUNDED, Expectations())
    rng = random.Random(seed)
    pool = list(problems) if problems is not None else embedded_task().sample(rng, n)
    chosen = [pool[i % len(pool)] for i in range(n)]
    try:
        fingerprint = model_fingerprint(json.loads((verifier_engine.loaded.path / "config.json").read_text()))
    except (OSError, ValueError):
        fingerprint = ""
    out = []
    for engine in engines:
        observed = Observed()
        for bs in batch_sizes:
            for start in range(0, n, bs):
                chunk = chosen[start:start + bs]
                seeds = [rng.randrange(1 << 63) for _ in chunk]
                recs = generate_rollouts(engine, tok, chunk, key=key, run_id="calibration", policy_version=0,
                                         checkpoint=_CAL_CID, sampling=sampling, seeds=seeds)
                for v in verifier.verify(recs):
                    if v.reason is not None:  # a cheap check failed: a bug, not a numerical figure
                        raise RuntimeError(f"honest rollout rejected during calibration: {v.reason} "
                                           f"{v.detail}")
                    f = v.figures
                    observed.add(int(f["exp_mismatches"]), f["mant_err_mean"], f["mant_err_median"],
                                 f["logprob_diff"], f["sampling_gap"])
        out.append(Calibration(dtype=verifier_engine.dtype, engines=[engine.name],
                               batch_sizes=list(batch_sizes), max_new_tokens=sampling.max_new_tokens,
                               observed=observed, margins=margins,
                               device=device_kind(str(getattr(engine, "device", "cpu"))),
                               verify_device=device_kind(str(verifier_engine.device)), model=fingerprint))
    return out
