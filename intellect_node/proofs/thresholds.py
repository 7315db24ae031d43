"""Acceptance thresholds for the validator's checks, and how calibration derives them from honest runs.

Every figure is a distance (larger = further from honest), so a rollout is accepted when each figure is
at or below its threshold. Thresholds are calibrated per (model, dtype, engine pair) by ``intellect-node
proofs calibrate``: honest rollouts are generated and verified, the worst figure seen for each check is
recorded, and the threshold is ``worst * factor + floor`` (the margin).

An engine pair is the generating engine and device kind against the verifier's (always the torch
engine): ``float32/vllm@cuda->torch@cpu``. Numerics differ per pair (vLLM's kernels, a GPU's reduction
order), so a pair not calibrated is an error naming the command that calibrates it, never a silent
default. A validator cannot tell which engine produced a rollout, so it accepts with the loosest
thresholds among the pairs the run admits (``run.rollout_engines``). The file (format 2)::

    {"format": 2, "pairs": {"float32/torch@cpu->torch@cpu": {calibration...}, ...}}

Older files keyed by dtype alone (the embedded model's) read as CPU pairs of each engine they list.
Entries carry the model's architecture fingerprint (:func:`model_fingerprint`); a file calibrated for
another architecture is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

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
    device: str = "cpu"
    """Device kind the rollouts were generated on (cpu, cuda)."""
    verify_device: str = "cpu"
    """Device kind of the verifier's prefill (torch engine)."""
    model: str = ""
    """The model's architecture fingerprint (:func:`model_fingerprint`); empty in older files."""

    @property
    def thresholds(self) -> Thresholds:
        return derive(self.observed, self.margins)

    @property
    def key(self) -> str:
        """The pair this calibration covers (its one generating engine; several: the first)."""
        return pair_key(self.dtype, f"{self.engines[0]}@{self.device}", self.verify_device)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "engines": self.engines, "device": self.device,
                "verify_device": self.verify_device, "model": self.model, "batch_sizes": self.batch_sizes,
                "max_new_tokens": self.max_new_tokens, "observed": asdict(self.observed),
                "margins": asdict(self.margins), "thresholds": asdict(self.thresholds)}


FORMAT = 2
FINGERPRINT_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
"""What identifies an architecture for thresholds: numerics change with these, not with the weights'
values (a run's policy versions share one calibration)."""


def device_kind(device: str) -> str:
    """``cuda:3`` -> ``cuda``: thresholds are per kind of device, not per index."""
    return "cuda" if device.startswith("cuda") else "cpu"


def pair_key(dtype: str, generator: str, verify_device: str) -> str:
    """``float32/vllm@cuda->torch@cpu``: ``generator`` is engine@device, the verifier is torch."""
    engine, _, device = generator.partition("@")
    return f"{dtype}/{engine}@{device_kind(device or 'cpu')}->torch@{device_kind(verify_device)}"


def model_fingerprint(config: Mapping[str, object]) -> str:
    """16 hex digits of sha256 over the architecture fields of a model's config.json."""
    picked = {k: config.get(k) for k in FINGERPRINT_KEYS}
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_pairs(data: object, where: Path | str) -> dict[str, dict[str, Any]]:
    """Pair key -> entry of a thresholds file's parsed JSON, older dtype-keyed files included."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a thresholds file (a JSON object)", field="thresholds")
    if data.get("format") == FORMAT:
        pairs = data.get("pairs")
        if not isinstance(pairs, dict):
            raise ConfigError(f"{where}: format 2 without a pairs object", field="thresholds")
        return dict(pairs)
    out: dict[str, dict[str, Any]] = {}
    for dtype, entry in data.items():  # format 1: {dtype: {"engines": [...], ...}}, calibrated on CPU
        if isinstance(entry, dict):
            for engine in entry.get("engines") or ["torch"]:
                out.setdefault(pair_key(dtype, f"{engine}@cpu", "cpu"), entry)
    return out


def merge_into(path: Path, cal: Calibration) -> dict[str, Any]:
    """The thresholds file at ``path`` (format 2) with ``cal`` set under its pair (other pairs kept)."""
    pairs: dict[str, dict[str, Any]] = {}
    if path.exists():
        try:
            pairs = read_pairs(json.loads(path.read_text()), path)
        except ValueError as exc:
            raise ConfigError(f"{path} is not JSON ({exc}); delete it and re-run calibrate",
                              field="out") from exc
    pairs[cal.key] = cal.to_json()
    return {"format": FORMAT, "pairs": dict(sorted(pairs.items()))}


def loosest(entries: Sequence[Thresholds]) -> Thresholds:
    """Per check, the largest threshold: what accepts every listed pair's honest rollouts."""
    return Thresholds(exp_mismatches=max(t.exp_mismatches for t in entries),
                      mant_err_mean=max(t.mant_err_mean for t in entries),
                      mant_err_median=max(t.mant_err_median for t in entries),
                      logprob_diff=max(t.logprob_diff for t in entries),
                      sampling_gap=max(t.sampling_gap for t in entries))


def load_thresholds(model_dir: Path, dtype: str, path: Path | None = None, *,
                    generators: Sequence[str] = ("torch@cpu",), verify_device: str = "cpu",
                    fingerprint: str = "", sha256: str | None = None) -> Thresholds:
    """The thresholds a verifier on torch at ``verify_device`` uses for rollouts generated by any of
    ``generators`` (engine@device) in ``dtype``, from ``path`` (default: the model folder's file): the
    loosest of the pairs' calibrated thresholds. A pair not calibrated, a file whose sha256 is not the
    run's (``sha256``) or an entry of another architecture (``fingerprint``) is a ConfigError."""
    path = path or model_dir / THRESHOLDS_FILE
    fix = (f"run `intellect-node proofs calibrate --model {model_dir} --dtype {dtype} --engines ENGINE "
           f"--device DEVICE --verify-device {device_kind(verify_device)}`")
    if not path.exists():
        raise ConfigError(f"no proof thresholds at {path}; {fix}", field="run.proof_thresholds")
    if sha256 is not None and file_sha256(path) != sha256:
        raise ConfigError(f"{path} has sha256 {file_sha256(path)}, not the run's {sha256}: this validator "
                          "would judge with other thresholds than the run's; get the run's file",
                          field="run.proof_thresholds_sha256")
    try:
        pairs = read_pairs(json.loads(path.read_text()), path)
    except ValueError as exc:
        raise ConfigError(f"{path} is not JSON ({exc})", field="run.proof_thresholds") from exc
    found: list[Thresholds] = []
    for gen in generators:
        key = pair_key(dtype, gen, verify_device)
        entry = pairs.get(key)
        if entry is None:
            have = ", ".join(sorted(pairs)) or "none"
            raise ConfigError(f"{path} has no thresholds for the engine pair {key} (calibrated: {have}); "
                              f"{fix}", field="run.proof_thresholds")
        model = entry.get("model") or ""
        if fingerprint and model and model != fingerprint:
            raise ConfigError(f"{path}: the {key} thresholds were calibrated on another architecture "
                              f"(fingerprint {model}, this model {fingerprint}); {fix}",
                              field="run.proof_thresholds")
        try:
            found.append(Thresholds(**entry["thresholds"]))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: the {key} entry has no valid thresholds ({exc}); {fix}",
                              field="run.proof_thresholds") from exc
    return loosest(found)


def worst(values: Iterable[float]) -> float:
    return max(values, default=0.0)
