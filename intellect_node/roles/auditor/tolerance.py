"""Audits where bitwise replay does not hold: compare a replayed step with the published one within a
tolerance calibrated on honest replays.

A replay is bitwise when it runs as the trainer ran: the CPU, one torch thread, the same compute dtype and
the same kernels. Measured on this project's CPU (bench/README.md, "audit"): a second run gives the same
bits; two threads did in one run and not in another on the embedded model (3e-6 of an update apart: the
BLAS may use fewer threads than asked on a busy machine, which changes the order of its sums) and never
on SmolLM2-135M; a CPU whose kernels differ
(emulated with ``ATEN_CPU_CAPABILITY`` avx2 or default against the trainer's avx512) never does, nor
would a GPU, whose reduction order differs again. There the auditor compares numbers instead of hashes.

What is compared: for each tensor, the difference between the replayed and the published weights
relative to the step's own update, ``|replayed - published| / |replayed - base|`` (Euclidean norms over
the tensor; ``base`` the weights the step started from). Against the update, not the weights, because the
update is what a dishonest trainer changes: a learning rate off by 10% moves every tensor by 0.1/1.1 of
its update, while other kernels' rounding moved the embedded model's worst tensor (a layer norm's 128
weights) by 2e-3 to 4e-3 of it (AdamW divides each gradient by its own running scale, so the rounding of
a near-zero gradient can flip an element's step; in a small tensor those few elements weigh most). Per
tensor, so that a change confined to one small tensor is not averaged away. A tensor that moved where
the replay did not (update norm 0) may not differ at all.

Calibration (:func:`calibrate`), as the proof thresholds are calibrated (``proofs/thresholds.py``):

1. the trainer's condition makes an honest chain of steps (the reference, what it would publish);
2. the auditor's condition replays each step from the reference's base weights with its own optimizer
   (what :class:`~intellect_node.roles.auditor.replay.WindowReplay` does after a step within tolerance:
   it continues from the published weights);
3. the worst relative difference over every tensor and step is the observation, and the tolerance is
   ``worst * factor + floor`` (:class:`AuditMargins`).

``intellect-node audit calibrate`` runs this on the run's own model and task for an auditor's thread
count (``calibration.py``, which also observes the optimizer state, compared at checkpoints);
``bench/audit.py`` for this CPU's other kernels. The run's tolerance is ``run.audit_tolerance`` (0: bitwise
only), a shared run setting, so a run joined by its manifest's CID carries it pinned with the rest of the
run's configuration; the chain auditor applies it (``chain.py``, ``published.py``). A replay of the same step
under one condition repeats its bits, so N honest observations are N different steps, not N repeats.

Shortcut: calibration covers the conditions it was run under (the thread counts and CPU kernels of the
machines that ran it); a GPU auditor needs a calibration made on a GPU, which nobody has run yet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from intellect_node.policy.weights import PolicyWeights

State = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class TensorDiff:
    """How far one tensor of a replayed step is from the published one."""

    name: str
    max_abs: float
    """Largest elementwise |replayed - published|."""
    relative: float
    """|replayed - published| / |replayed - base| (norms over the tensor); inf for a difference where the
    replay did not move the tensor at all, or for weights that are not finite."""
    finite: bool = True
    """False when the replayed or the published tensor holds NaN or inf."""


def _relative(diff_norm: float, update_norm: float) -> float:
    if diff_norm == 0.0:
        return 0.0
    out = diff_norm / update_norm if update_norm > 0.0 else math.inf
    return out if not math.isnan(out) else math.inf  # a NaN base: never within either


def tensor_diffs(replayed: State, published: State, base: State) -> list[TensorDiff]:
    """Per tensor, how far ``published`` is from ``replayed`` (the step from ``base``). ValueError when the
    three do not hold the same tensor names and shapes."""
    if set(replayed) != set(published) or set(replayed) != set(base):
        odd = sorted(set(replayed) ^ set(published) | set(replayed) ^ set(base))
        raise ValueError(f"the weights do not name the same tensors: {odd[:3]}")
    out = []
    for name in sorted(replayed):
        r, p, b = replayed[name], published[name], base[name]
        if r.shape != p.shape or r.shape != b.shape:
            raise ValueError(f"tensor {name}: shapes {tuple(r.shape)}, {tuple(p.shape)}, {tuple(b.shape)}")
        if not r.is_floating_point():
            out.append(TensorDiff(name, 0.0 if torch.equal(r, p) else math.inf,
                                  0.0 if torch.equal(r, p) else math.inf))
            continue
        r64, p64 = r.detach().double(), p.detach().double()
        if not (bool(torch.isfinite(r64).all()) and bool(torch.isfinite(p64).all())):
            # NaN compares false both ways: left as it is, it passes ``<= tolerance`` checks as the
            # worst tensor's key, or hides behind another tensor in :func:`worst`. Never within.
            out.append(TensorDiff(name, math.inf, math.inf, finite=False))
            continue
        d = r64 - p64
        out.append(TensorDiff(name, float(d.abs().max()) if d.numel() else 0.0,
                              _relative(float(d.norm()), float((r64 - b.detach().double()).norm()))))
    return out


def worst(diffs: Iterable[TensorDiff]) -> TensorDiff | None:
    """The tensor furthest from the published one (by relative difference); None for no tensors."""
    return max(diffs, key=lambda d: (d.relative, d.max_abs), default=None)


@dataclass(frozen=True)
class Comparison:
    within: bool
    worst: TensorDiff | None
    tolerance: float

    @property
    def reason(self) -> str:
        w = self.worst
        if w is None:
            return "no tensors compared"
        if not w.finite:
            return f"tensor {w.name} is not finite (NaN or inf) in the replayed or the published step"
        return (f"tensor {w.name} differs from the published one by {w.relative:.3g} of its update (max "
                f"|diff| {w.max_abs:.3g}); tolerance {self.tolerance:.3g}")


def compare(replayed: State, published: PolicyWeights | State, tolerance: float, *,
            base: State) -> Comparison:
    """Whether ``replayed`` (the auditor's step from ``base``) is within ``tolerance`` of ``published``
    (the weights the trainer published for that step): every tensor's relative difference at or below it.
    Tensors named differently, or shaped differently, are never within."""
    pub = published.to_state_dict() if isinstance(published, PolicyWeights) else published
    try:
        diffs = tensor_diffs(replayed, pub, base)
    except ValueError as exc:
        return Comparison(False, TensorDiff(str(exc), math.inf, math.inf), tolerance)
    w = worst(diffs)
    return Comparison(w is None or w.relative <= tolerance, w, tolerance)


@dataclass(frozen=True)
class AuditMargins:
    """tolerance = worst * factor + floor. The factor leaves room for steps the calibration did not see
    (other batches, a longer run) and stays below what a dishonest change moves: in fp32 the worst honest
    difference across CPU kernels was 2e-3 to 6e-3 of an update (the embedded model, SmolLM2-135M) and a
    learning rate 10% off 0.09 (bench/README.md, "audit"), so 4x keeps the tolerance (0.023 at most)
    under a quarter of it. In bf16 autocast rounding reaches 0.035-0.33 of an update and no tolerance
    separates it from a dishonest change. The floor keeps a calibration that saw no difference at all from
    demanding bitwise equality."""

    factor: float = 4.0
    floor: float = 1e-5


@dataclass(frozen=True)
class AuditCalibration:
    """What :func:`calibrate` saw and the tolerance it derives."""

    condition: str
    """The auditor's condition against the trainer's, e.g. ``cpu avx2, 1 thread -> cpu avx512, 1 thread``."""
    steps: int
    observed: float
    """The worst relative difference over every tensor and step."""
    worst_tensor: str
    max_abs: float
    """The largest elementwise difference seen (any tensor, any step)."""
    margins: AuditMargins = field(default_factory=AuditMargins)

    @property
    def tolerance(self) -> float:
        return self.observed * self.margins.factor + self.margins.floor

    def to_json(self) -> dict[str, object]:
        return {"condition": self.condition, "steps": self.steps, "observed": self.observed,
                "worst_tensor": self.worst_tensor, "max_abs": self.max_abs, "margins": asdict(self.margins),
                "tolerance": self.tolerance}


def calibrate(steps: Iterable[tuple[State, State, State]], *, condition: str,
              margins: AuditMargins = AuditMargins()) -> AuditCalibration:
    """The tolerance from honest steps, each ``(base, replayed, published)``: the weights the step started
    from, what the auditor's condition replayed and what the trainer's condition made. A difference that
    is infinite (a tensor the replay left unchanged moved) is refused: no tolerance covers it."""
    n, seen, seen_abs, name = 0, 0.0, 0.0, ""
    for base, replayed, published in steps:
        n += 1
        diffs = tensor_diffs(replayed, published, base)
        w = worst(diffs)
        if w is None:
            continue
        if not w.finite:
            raise ValueError(f"step {n}: tensor {w.name} is not finite (NaN or inf)")
        if not math.isfinite(w.relative):
            raise ValueError(f"step {n}: tensor {w.name} moved in the published step but not in the replay")
        if w.relative > seen:
            seen, name = w.relative, w.name
        seen_abs = max(seen_abs, max(d.max_abs for d in diffs))
    if n == 0:
        raise ValueError("no honest steps to calibrate on")
    return AuditCalibration(condition=condition, steps=n, observed=seen, worst_tensor=name, max_abs=seen_abs,
                            margins=margins)
