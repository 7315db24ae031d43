"""What a role runs its model on, and whether it can: the ``[inference]`` section applied.

* :func:`engine_choice`: the configured ``engine`` (auto, torch, vllm) and ``device`` resolved once per
  role (``inference.choose_engine``), logged with the reason, with vLLM's settings;
* :func:`run_thresholds`: a validator's thresholds for the run's engine pairs (``run.rollout_engines``
  generating, torch on this node's device verifying), from the run's thresholds file, hash-checked;
* :func:`require_rollout_engine`: a worker whose engine the run does not admit refuses to start (its
  rollouts would be judged with thresholds calibrated for other numerics);
* :func:`check_fits`: the memory estimate of ``inference/memory.py`` against this machine, at start.

Every refusal is a :class:`ConfigError` (the node exits 2) naming the field and the fix.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from intellect_node.config import NodeConfig
from intellect_node.errors import ConfigError
from intellect_node.inference import choose_engine
from intellect_node.inference.base import VllmSettings
from intellect_node.inference.memory import (
    Estimate,
    available_bytes,
    fmt_bytes,
    model_shape,
    role_estimate,
)
from intellect_node.proofs.thresholds import Thresholds, device_kind, load_thresholds, model_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineChoice:
    name: str
    """torch or vllm."""
    device: str
    reason: str
    vllm: VllmSettings
    """VllmEngine keyword arguments from the config (used only when ``name`` is vllm)."""

    @property
    def kind(self) -> str:
        """engine@device-kind, as ``run.rollout_engines`` lists it."""
        return f"{self.name}@{device_kind(self.device)}"


def engine_choice(cfg: NodeConfig, role: str) -> EngineChoice:
    inf = cfg.inference
    name, why = choose_engine(inf.engine, inf.device)
    log.info("%s engine: %s on %s (%s)", role, name, inf.device, why)
    context = inf.max_prompt_tokens + cfg.rl.max_new_tokens
    vllm: VllmSettings = {"max_model_len": context, "max_num_seqs": inf.vllm_max_num_seqs,
            "gpu_memory_fraction": inf.vllm_gpu_memory_fraction,
            "max_num_batched_tokens": inf.vllm_max_num_batched_tokens,
            "enforce_eager": inf.vllm_enforce_eager, "cpu_kvcache_gib": inf.vllm_cpu_kvcache_gib}
    return EngineChoice(name=name, device=inf.device, reason=why, vllm=vllm)


def require_rollout_engine(cfg: NodeConfig, choice: EngineChoice) -> None:
    if choice.kind not in cfg.run.rollout_engines:
        raise ConfigError(f"this worker would generate with {choice.kind} ({choice.reason}) but the run "
                          f"admits {', '.join(cfg.run.rollout_engines)}: validators judge with thresholds "
                          "calibrated for those; set inference.engine/inference.device to one of them, "
                          f"or ask the run's organiser to calibrate {choice.kind} and list it",
                          field="run.rollout_engines")


def _fingerprint(model_dir: Path) -> str:
    try:
        return model_fingerprint(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError):
        return ""


def run_thresholds(cfg: NodeConfig, model_dir: Path) -> Thresholds:
    """The loosest calibrated thresholds over the run's engine pairs for a verifier on this device."""
    path = Path(cfg.run.proof_thresholds) if cfg.run.proof_thresholds else None
    th = load_thresholds(model_dir, cfg.run.dtype, path, generators=cfg.run.rollout_engines,
                         verify_device=cfg.inference.device, fingerprint=_fingerprint(model_dir),
                         sha256=cfg.run.proof_thresholds_sha256)
    log.info("validator thresholds for %s -> torch@%s: %s", ", ".join(cfg.run.rollout_engines),
             device_kind(cfg.inference.device), th)
    return th


def estimate_for(cfg: NodeConfig, model_dir: Path, role: str) -> Estimate:
    """The memory ``role`` needs with this config: its batch, context, dtype and engine."""
    rl, inf = cfg.rl, cfg.inference
    tokens = inf.max_prompt_tokens + rl.max_new_tokens
    batch = rl.group_size if role == "trainer" else rl.problems_per_batch * rl.group_size
    engine = choose_engine(inf.engine, inf.device)[0]
    return role_estimate(model_shape(model_dir), role, cfg.run.dtype, batch=batch, tokens=tokens,
                         engine=engine, versions=cfg.run.async_level + 1)


def fit_problem(estimate: Estimate, free: int, where: str) -> str:
    """"" when ``estimate`` fits in ``free`` bytes; otherwise what does not fit and how to make it."""
    if estimate.total <= free:
        return ""
    s = estimate.settings
    fixes = ["a smaller batch (rl.problems_per_batch, rl.group_size) or context "
             "(inference.max_prompt_tokens, rl.max_new_tokens)"]
    if s.get("dtype") == "float32":
        fixes.append("run.dtype bfloat16 (the whole run)")
    fixes.append("another role or a machine with more memory")
    return (f"the {estimate.role} needs about {fmt_bytes(estimate.total)} ({estimate.describe()}; batch "
            f"{s.get('batch')}, {s.get('tokens')} tokens, {s.get('dtype')}) but {where} is "
            f"{fmt_bytes(free)}; try {', or '.join(fixes)}")


def check_fits(cfg: NodeConfig, roles: Sequence[str], model_dir: Path) -> None:
    """Refuse (ConfigError, exit 2) a role that clearly does not fit, per ``inference.memory_check``."""
    mode = cfg.inference.memory_check
    wanted = [r for r in dict.fromkeys(roles) if r in ("worker", "validator", "trainer")]
    if mode == "off" or not wanted:
        return
    free, where = available_bytes(cfg.inference.device)
    estimates = [estimate_for(cfg, model_dir, r) for r in wanted]
    total = Estimate(role=" + ".join(wanted), parts={f"{e.role}: {k}": v for e in estimates
                                                     for k, v in e.parts.items()},
                     settings=estimates[0].settings)
    problem = fit_problem(total, free, where)
    if not problem:
        log.info("memory: %s need about %s of %s %s", total.role, fmt_bytes(total.total), fmt_bytes(free),
                 where)
    elif mode == "warn":
        log.warning("memory: %s (inference.memory_check = warn: starting anyway)", problem)
    else:
        raise ConfigError(problem + "; or set inference.memory_check = \"warn\" to start anyway",
                          field="inference.memory_check")
