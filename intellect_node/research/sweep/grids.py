"""The jobs of a sweep: the named grids, what one job costs (and so its deadline), and running one here.

A job is a :class:`~intellect_node.protocol.sweep.JobSpec` (the wire struct; :func:`job_id` names it).
Deadlines are derived from a pessimistic estimate of a job's run time, so a slow but honest peer makes
them; they are a backstop, since heartbeats report vanished peers within seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from intellect_node.errors import ConfigError
from intellect_node.protocol import sweep as wire
from intellect_node.protocol.sweep import JobSpec

if TYPE_CHECKING:
    from intellect_node.research.polysemanticity import RunResult

GRIDS = ("smoke", "paper", "noise", "tiny")
MIN_DEADLINE_S = 120.0
DEADLINE_FACTOR = 10.0
"""Deadlines are a backstop (heartbeats report dead peers within seconds), so they are generous: on a
2-core machine at load 20, smoke jobs ran 3-4x slower than the estimate and 60 s + 3x expired two."""
ASSUMED_FLOPS = 5e9
"""Single-thread float32 rate assumed for deadlines: well under a modern core, so slow peers make it."""
ASSUMED_STEP_OVERHEAD_S = 2e-4
"""Python and dispatch cost per training step, measured at about 1e-4 s on a loaded 2-core machine."""


def poly_job(n: int, m: int, seed: int, *, steps: int = 7500) -> JobSpec:
    """The main experiment's settings (AdamW lr 1e-3, torch's default decay 0.01, L1 1e-3)."""
    return JobSpec(variant="poly", n=n, m=m, seed=seed, steps=steps, lr=1e-3, l1=1e-3, weight_decay=0.01)


def noise_job(noise: str, sigma: float, seed: int, *, steps: int = 100_000,
              record_every: int = 1000) -> JobSpec:
    """The noise variant's settings (n 8, m 16, SGD lr 0.02, no L1)."""
    return JobSpec(variant="noise", n=8, m=16, seed=seed, steps=steps, lr=0.02, l1=0.0, noise=noise,
                   sigma=sigma, record_every=record_every)


def grid(name: str) -> list[JobSpec]:
    """The jobs of a named grid.

    - ``smoke``: n 64, m in {64, 128, 256, 512}, seeds 0-9 (40 jobs, minutes on one core);
    - ``paper``: n 256, m 256..4096 in steps of 256, 16 seeds (256 jobs, hours: for a real swarm);
    - ``noise``: Bernoulli and Gaussian noise at sigma 0.07, 0.1, 0.15, plus a noiseless baseline,
      5 instances each (35 jobs);
    - ``tiny``: n 16, m in {16, 32}, 3 seeds, 1500 steps: for tests and demos, not a result.
    """
    if name == "smoke":
        return [poly_job(64, m, s) for m in (64, 128, 256, 512) for s in range(10)]
    if name == "paper":
        return [poly_job(256, m, s) for m in range(256, 4097, 256) for s in range(16)]
    if name == "noise":
        kinds = [(k, sg) for k in ("bernoulli", "gaussian") for sg in (0.07, 0.1, 0.15)] + [("none", 0.0)]
        return [noise_job(k, sg, s) for k, sg in kinds for s in range(5)]
    if name == "tiny":
        return [poly_job(16, m, s, steps=1500) for m in (16, 32) for s in range(3)]
    raise ConfigError(f"--grid {name!r} is not a grid; use one of {', '.join(GRIDS)}", field="grid")


def estimated_seconds(spec: JobSpec) -> float:
    """A pessimistic single-thread run time: matmul flops at :data:`ASSUMED_FLOPS` plus step overhead."""
    n, m = spec.n, spec.m
    per_step = (6 if spec.variant == "noise" else 4) * n * n * m + 20 * n * m
    return spec.steps * (per_step / ASSUMED_FLOPS + ASSUMED_STEP_OVERHEAD_S)


def default_deadline_s(spec: JobSpec) -> float:
    """Time a peer gets for one job: two minutes plus ten times the pessimistic estimate."""
    return MIN_DEADLINE_S + DEADLINE_FACTOR * estimated_seconds(spec)


def execute(spec: JobSpec) -> RunResult:
    """Run one job here (torch, one thread) and return its ``RunResult``; for workers, never the loop."""
    from intellect_node.research import polysemanticity as poly

    wire.check_spec(spec)
    if spec.variant == "poly":
        return poly.run_polysemanticity(spec.n, spec.m, spec.seed, steps=spec.steps, lr=spec.lr, l1=spec.l1,
                                        weight_decay=spec.weight_decay)
    # check_spec admitted only NoiseKind's names; the wire struct holds a plain str.
    return poly.run_noise(spec.n, spec.m, spec.seed, noise=spec.noise, sigma=spec.sigma,  # type: ignore[arg-type]
                          steps=spec.steps, lr=spec.lr, l1=spec.l1, record_every=spec.record_every)
