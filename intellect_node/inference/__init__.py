"""Inference engines behind one seam (:class:`InferenceEngine`), rollout building and verification.

Callers choose an engine with :func:`make_engine` and use it through the protocol. ``torch_engine`` is the
default and the only one the verifier's prefill runs on; ``vllm_engine`` is imported lazily (extra
``intellect-node[vllm]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from intellect_node.inference.base import Generation, InferenceEngine, SamplingConfig

if TYPE_CHECKING:
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.models.loader import LoadedModel

__all__ = ["ENGINES", "Generation", "InferenceEngine", "SamplingConfig", "make_engine"]

ENGINES = ("torch", "vllm")


@overload
def make_engine(model: LoadedModel | str | Path | None, engine: Literal["torch"] = "torch", *,
                dtype: str = "float32", device: str = "cpu") -> TorchEngine: ...


@overload
def make_engine(model: LoadedModel | str | Path | None, engine: str, *, dtype: str = "float32",
                device: str = "cpu") -> InferenceEngine: ...


def make_engine(model: LoadedModel | str | Path | None, engine: str = "torch", *, dtype: str = "float32",
                device: str = "cpu") -> InferenceEngine:
    """An engine named ``engine`` for ``model``: weights already loaded (a policy version a role obtained;
    ``dtype`` is then the loaded one), or a model directory (None: the embedded model) loaded in
    ``dtype``. The torch engine is what the verifier recomputes with, so ``"torch"`` returns it typed as
    :class:`~intellect_node.inference.torch_engine.TorchEngine`.

    vLLM loads its weights from a directory itself, so it takes a directory only."""
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

        return VllmEngine(model, dtype=dtype)
    raise ConfigError(f"engine {engine!r} is not one of {', '.join(ENGINES)}", field="engine")
