"""AdamW for a trainer on the CPU, without ``torch.optim``'s import of ``torch._dynamo``.

Constructing any ``torch.optim`` optimizer, and its first ``step``, ``zero_grad`` or ``state_dict``,
imports ``torch._dynamo`` (their ``torch._disable_dynamo`` wrappers import it on first call): about 1 s of
one core on the development machine, on the path to a fresh trainer's first step (docs/training.md,
"Start-up"). The trainer never compiles, so on the CPU it steps with :class:`CpuAdamW` instead.

:class:`CpuAdamW` is ``torch.optim.AdamW``'s CPU update, operation for operation (torch's single-tensor
path, which is what it runs for CPU parameters: no foreach or fused kernels there), so its weights are
bit-identical to torch's step after step (``tests/trainer/test_optim.py``). Its ``state_dict`` has torch's
format (state keyed by parameter index with ``step``, ``exp_avg`` and ``exp_avg_sq``; torch's param-group
keys), so a checkpoint written by either loads into the other and continues bit-identically (what lets a
run move between a CPU and a GPU trainer; the GPU side is not tested on the development machine).

On GPUs, and wherever a trainer shards its parameters (DDP, FSDP2: ``trainer/distributed.py``),
``torch.optim.AdamW`` stays: its foreach and fused kernels are what such runs want, and there the import
is a fixed second of a long start.

Shortcuts: one parameter group; no amsgrad, maximize, capturable or differentiable modes (torch's
defaults, which the trainer uses); real tensors only.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from intellect_node.errors import ConfigError

_GROUP_DEFAULTS: dict[str, bool | None] = {"amsgrad": False, "foreach": None, "maximize": False,
                                             "capturable": False, "differentiable": False, "fused": None,
                                             "decoupled_weight_decay": True}
"""The param-group keys torch's AdamW writes beside lr, betas, eps and weight_decay, with the values this
class implements; a saved state whose group says otherwise is refused."""


class CpuAdamW:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` for CPU tensors, with its defaults (see the
    module)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        params = [p for p in params]
        if not params:
            raise ConfigError("the optimizer got no parameters", field="model")
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ConfigError(f"AdamW needs lr >= 0, eps >= 0, betas in [0, 1) and weight_decay >= 0; got lr "
                              f"{lr}, eps {eps}, betas {betas}, weight_decay {weight_decay}", field="lr")
        if not self.takes(params):
            raise ValueError("CpuAdamW takes real, plain CPU tensors (not sharded, not on a GPU)")
        group = {"params": params, "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = [{**group, **_GROUP_DEFAULTS}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @staticmethod
    def takes(params: Sequence[torch.Tensor]) -> bool:
        """Whether every parameter is a real, plain CPU tensor (what this class steps exactly as torch)."""
        return all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type == "cpu"
                   and not p.is_complex() for p in params)

    @property
    def _params(self) -> list[torch.Tensor]:
        params: list[torch.Tensor] = self.param_groups[0]["params"]
        return params

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient (torch's ``_single_tensor_adam`` with
        decoupled weight decay, the same operations in the same order)."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in self._params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            st = self.state.get(p)
            if st is None:
                st = self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            grad, exp_avg, exp_avg_sq = p.grad, st["exp_avg"], st["exp_avg_sq"]
            st["step"] += 1
            if wd != 0:
                p.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = st["step"].item()
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch's format: ``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}``."""
        index = {id(p): i for i, p in enumerate(self._params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": {index[id(p)]: dict(st) for p, st in self.state.items()},
                "param_groups": [{**group, "params": list(range(len(self._params)))}]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Load a state in torch's format (from this class or ``torch.optim.AdamW``), checked against the
        parameters first: a mismatch raises ``ValueError`` naming it and changes nothing."""
        groups, params = saved.get("param_groups"), self._params
        if not isinstance(groups, list) or len(groups) != 1:
            count = len(groups) if isinstance(groups, list) else "no"
            raise ValueError(f"saved optimizer state has {count} parameter groups; this trainer's has 1")
        group = groups[0]
        if list(group.get("params", [])) != list(range(len(params))):
            raise ValueError(f"saved optimizer state covers {len(group.get('params', []))} parameters; the "
                             f"model has {len(params)}")
        odd = {k: group[k] for k, v in _GROUP_DEFAULTS.items()
               if k not in ("foreach", "fused") and group.get(k, v) != v}
        if odd:
            raise ValueError(f"saved optimizer state uses AdamW options this trainer does not implement: "
                             f"{odd}")
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for i, st in saved.get("state", {}).items():
            if not isinstance(i, int) or not 0 <= i < len(params):
                raise ValueError(f"saved optimizer state names parameter {i!r}; the model has {len(params)}")
            p = params[i]
            for key in ("exp_avg", "exp_avg_sq"):
                t = st.get(key)
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    raise ValueError(f"saved optimizer state for parameter {i} has {key} of shape "
                                     f"{getattr(t, 'shape', None)}; the parameter is {tuple(p.shape)}")
            state[p] = {"step": torch.as_tensor(st["step"], dtype=torch.float32).clone(),
                        "exp_avg": st["exp_avg"].to(dtype=p.dtype, device=p.device, copy=True),
                        "exp_avg_sq": st["exp_avg_sq"].to(dtype=p.dtype, device=p.device, copy=True)}
        self.state = state
        self.param_groups[0].update({k: group[k] for k in ("lr", "betas", "eps", "weight_decay")
                                     if k in group})
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])


Optimizer = torch.optim.Optimizer | CpuAdamW
"""What the trainer steps with: :class:`CpuAdamW` on the CPU, ``torch.optim.AdamW`` elsewhere."""
