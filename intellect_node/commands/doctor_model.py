"""``intellect-node doctor --model M``: will this machine hold the model in the role it is meant for?

The estimate (``inference/memory.py``: weights, KV cache, training state) uses the node's configuration
for the batch and context (``rl.problems_per_batch * rl.group_size``, ``inference.max_prompt_tokens +
rl.max_new_tokens``) and is compared with what is free where the tensors go: this machine's available RAM
or, on CUDA, the GPU's free memory. The same comparison stops ``join`` at start
(``roles/common/engines.check_fits``, ``inference.memory_check``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from intellect_node.commands.checks import FAIL, OK, WARN, Check
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig

ROLES = ("worker", "validator", "trainer")
TIGHT = 0.8
"""Above this share of the free memory a role fits on paper but activations, the allocator and (on CUDA)
the context (~0.5 GiB) may not: a warning."""


def check_model_memory(cfg: NodeConfig, model: str, roles: Sequence[str], *, dtype: str | None = None,
                       device: str | None = None) -> list[Check]:
    """One check per role: its estimate, part by part, against the free memory of ``device``."""
    from intellect_node.inference.memory import available_bytes, fmt_bytes, model_shape
    from intellect_node.models.loader import resolve_model_dir
    from intellect_node.roles.common.engines import estimate_for, fit_problem

    try:
        path = resolve_model_dir(model or None)
        run = cfg.run.model_copy(update={"model": str(path), **({"dtype": dtype} if dtype else {})})
        inference = cfg.inference.model_copy(update={"device": device} if device else {})
        cfg = cfg.model_copy(update={"run": run, "inference": inference})
        shape = model_shape(path)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        return [Check("memory", FAIL, f"{model}: {exc}", "pass a model folder with config.json")]
    try:
        free, where = available_bytes(cfg.inference.device)
    except (RuntimeError, AssertionError) as exc:  # torch without CUDA raises these for a cuda device
        return [Check("memory", FAIL, f"{cfg.inference.device}: {exc}", "pass --device cpu")]
    counted = "counted from the weights" if shape.exact else "from config.json (no weights here)"
    out = [Check("model size", OK, f"{path.name}: {shape.n_params / 1e6:.1f}M parameters ({counted}), "
                 f"{shape.n_layers} layers, {shape.n_kv_heads} KV heads x {shape.head_dim}; {where}: "
                 f"{fmt_bytes(free)}")]
    for role in roles:
        est = estimate_for(cfg, path, role)
        problem = fit_problem(est, free, where)
        text = f"needs about {fmt_bytes(est.total)} of {fmt_bytes(free)} free: {est.describe()}"
        if problem:
            out.append(Check(f"{role} memory", FAIL, problem,
                             "change the settings named, or run another role"))
        elif est.total > TIGHT * free:
            out.append(Check(f"{role} memory", WARN, text, "tight: activations and the allocator need "
                             "room too; a smaller batch or bfloat16 leaves some"))
        else:
            out.append(Check(f"{role} memory", OK, text))
    return out
