"""Acceptance thresholds for the validator's checks, and how calibration derives them from honest runs.

Every figure is a distance (larger = further from honest), so a rollout is accepted when each figure is
at or below its threshold. Thresholds are calibrated per model, engine pair and dtype by
``intellect-node proofs calibrate``: honest rollouts are generated and verified, the worst figure seen
for each check is recorded, and the threshold is ``worst * factor + floor`` (the margin). The defaults
shipped for the embedded model are in its folder, ``proof_thresholds.json``, keyed by dtype.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from intellect_node.errors import ConfigError

THRESHOLDS_FILE = "proof_thresholds.json"


@dataclass(frozen=True)
class Thresholds:
    exp_mismatches: int
    """TOPLOC: bf16 exponent mismatches among the 128 top-k values of a 32-token chunk."""
    mant_err_mean: float
    """TOPLOC: mean |mantissa difference| (bf16 units) where exponents agree."""
    mant_err_median: float
    logprob_diff: float
    """max |claimed - recomputed| token logprob (nats)."""
    sampling_gap: float
    """max over positions of the best Gumbel score minus the claimed token's (nats)."""


@dataclass
class Observed:
    """Worst figures seen over honest rollouts (what calibration measures)."""

    rollouts: int = 0
    exp_mismatches: int = 0
    mant_err_mean: float = 0.0
    mant_err_median: float = 0.0
    logprob_diff: float = 0.0
    sampling_gap: float = 0.0

    def add(self, exp_mismatches: int, mant_err_mean: float, mant_err_median: float, logprob_diff: float,
            sampling_gap: float) -> None:
        self.rollouts += 1
        self.exp_mismatches = max(self.exp_mismatches, exp_mismatches)
        self.mant_err_mean = max(self.mant_err_mean, mant_err_mean)
        self.mant_err_median = max(self.mant_err_median, mant_err_median)
        self.logprob_diff = max(self.logprob_diff, logprob_diff)
        self.sampling_gap = max(self.sampling_gap, sampling_gap)


@dataclass(frozen=True)
class Margins:
    """threshold = worst * factor + floor, per check. Floors keep a near-zero worst case from making a
    threshold that the next honest run's last-bit rounding would cross."""

    factor: float = 2.0
    exp_floor: int = 2
    mant_mean_floor: float = 0.5
    mant_median_floor: float = 1.0
    logprob_floor: float = 1e-3
    gap_floor: float = 1e-3


def derive(observed: Observed, margins: Margins = Margins()) -> Thresholds:
    m = margins
    return Thresholds(
        exp_mismatches=int(observed.exp_mismatches * m.factor) + m.exp_floor,
        mant_err_mean=observed.mant_err_mean * m.factor + m.mant_mean_floor,
        mant_err_median=observed.mant_err_median * m.factor + m.mant_median_floor,
        logprob_diff=observed.logprob_diff * m.factor + m.logprob_floor,
        sampling_gap=observed.sampling_gap * m.factor + m.gap_floor,
    )


@dataclass
class Calibration:
    """One calibration result, as written to ``proof_thresholds.json`` under its dtype."""

    dtype: str
    engines: list[str]
    batch_sizes: list[int]
    max_new_tokens: int
    observed: Observed
    margins: Margins = field(default_factory=Margins)

    @property
    def thresholds(self) -> Thresholds:
        return derive(self.observed, self.margins)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "engines": self.engines, "batch_sizes": self.batch_sizes,
                "max_new_tokens": self.max_new_tokens, "observed": asdict(self.observed),
                "margins": asdict(self.margins), "thresholds": asdict(self.thresholds)}


def merge_into(path: Path, cal: Calibration) -> dict[str, Any]:
    """The thresholds file at ``path`` with ``cal`` set under its dtype (other dtypes kept)."""
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ConfigError(f"{path} is not JSON ({exc}); delete it and re-run calibrate",
                              field="out") from exc
    data[cal.dtype] = cal.to_json()
    return data


def load_thresholds(model_dir: Path, dtype: str, path: Path | None = None) -> Thresholds:
    """The calibrated thresholds for ``dtype`` from ``path`` (default: the model folder's file)."""
    path = path or model_dir / THRESHOLDS_FILE
    if not path.exists():
        raise ConfigError(f"no proof thresholds at {path}; run `intellect-node proofs calibrate --model "
                          f"{model_dir} --dtype {dtype}`", field="thresholds")
    try:
        entry = json.loads(path.read_text())[dtype]["thresholds"]
        return Thresholds(**entry)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} has no thresholds for dtype {dtype}; run `intellect-node proofs "
                          f"calibrate --dtype {dtype}`", field="thresholds") from exc


def worst(values: Iterable[float]) -> float:
    return max(values, default=0.0)
