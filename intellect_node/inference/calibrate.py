"""Calibrate the validator's thresholds from honest rollouts (``intellect-node proofs calibrate``).

Honest rollouts of the embedded task are generated at each batch size (batch composition changes the
kernels' shapes and so the last bits), verified by batched prefill in the validator's own grouping, and
the worst figure of each check is kept; thresholds add the margins of :class:`Margins`. Every other
engine given (e.g. vLLM) is a second source of honest rollouts verified against the same prefill.
"""

from __future__ import annotations

import random
from typing import Sequence

from intellect_node.inference.base import InferenceEngine, SamplingConfig
from intellect_node.inference.rollouts import generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.proofs.thresholds import Calibration, Margins, Observed, Thresholds
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import SigningKey
from intellect_node.trainer.tasks import embedded_task

_UNBOUNDED = Thresholds(exp_mismatches=10 ** 9, mant_err_mean=float("inf"), mant_err_median=float("inf"),
                        logprob_diff=float("inf"), sampling_gap=float("inf"))
_CAL_CID = cid_of(b"intellect-node calibration")  # a well-formed CID; calibration does not check it


def calibrate(verifier_engine: TorchEngine, engines: Sequence[InferenceEngine] = (), *, n: int = 64,
              batch_sizes: Sequence[int] = (1, 32), sampling: SamplingConfig = SamplingConfig(),
              seed: int = 0, margins: Margins = Margins()) -> Calibration:
    """Worst honest figures over ``n`` rollouts per (engine, batch size), and thresholds with margins."""
    engines = list(engines) or [verifier_engine]
    tok = verifier_engine.loaded.tokenizer
    key = SigningKey(bytes(32))
    verifier = Verifier(verifier_engine, _UNBOUNDED, Expectations())
    observed = Observed()
    rng = random.Random(seed)
    problems = embedded_task().sample(rng, n)
    for engine in engines:
        for bs in batch_sizes:
            for start in range(0, n, bs):
                chunk = problems[start:start + bs]
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
    return Calibration(dtype=verifier_engine.dtype, engines=[e.name for e in engines],
                       batch_sizes=list(batch_sizes), max_new_tokens=sampling.max_new_tokens,
                       observed=observed, margins=margins)
