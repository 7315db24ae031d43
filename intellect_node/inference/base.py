"""The inference-engine seam: what the worker needs from any backend (torch, vLLM).

An engine samples completions for a batch of prompts with the reproducible Gumbel-max sampler of
``proofs/sampling.py`` (one noise key per row) and returns, per row, the completion's token IDs, their
logprobs and the final-norm hidden states that produced each token (the TOPLOC input). Hidden states come
back as float32 on the CPU whatever the engine's dtype, shape ``[n_tokens, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Mapping, Protocol, Sequence, TypedDict, runtime_checkable

import torch

if TYPE_CHECKING:
    from intellect_node.models.loader import LoadedModel


@dataclass(frozen=True)
class SamplingConfig:
    """Batch-wide sampling settings (the per-rollout seed travels as a noise key)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    ignore_eos: bool = False
    """Benchmarks only: keep sampling past ``<eos>`` (rollouts made so fail the termination check)."""


@dataclass(frozen=True)
class Generation:
    prompt_tokens: list[int]
    tokens: list[int]
    """Generated tokens, ending with an EOS ID unless max_new_tokens was reached first."""
    logprobs: list[float]
    hidden: torch.Tensor
    """[len(tokens), hidden] float32: the final-norm hidden state each token was sampled from."""


@runtime_checkable
class InferenceEngine(Protocol):
    name: str
    dtype: str
    eos_id: int

    @property
    def eos_ids(self) -> Collection[int]:
        """Every token ID that ends a completion (chat models have several); ``eos_id`` is the first.
        Read-only here, so an engine may hold any collection (a frozenset, a list)."""

    def generate(self, prompts: Sequence[Sequence[int]], keys: Sequence[int],
                 sampling: SamplingConfig) -> list[Generation]: ...


@runtime_checkable
class WeightSwapEngine(InferenceEngine, Protocol):
    """An engine that takes a new policy version's weights in place (:class:`~.vllm_engine.VllmEngine`:
    restarting vLLM for each version would cost its whole start-up); the torch engine is made anew."""

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...


class VllmSettings(TypedDict, total=False):
    """:class:`~.vllm_engine.VllmEngine`'s keyword arguments from the configuration (``[inference]``'s
    ``vllm_*`` fields; the context length from the prompt and completion limits)."""

    max_model_len: int
    max_num_seqs: int
    gpu_memory_fraction: float
    max_num_batched_tokens: int | None
    enforce_eager: bool
    cpu_kvcache_gib: int


class LoadedEngine(Protocol):
    """An engine with the model it loaded in memory (:class:`~.torch_engine.TorchEngine`, or one wrapping
    it): what measures that tokenize prompts with the engine's own tokenizer take (solve rates, the
    preflight of a run's settings)."""

    @property
    def loaded(self) -> LoadedModel: ...

    def generate(self, prompts: Sequence[Sequence[int]], keys: Sequence[int],
                 sampling: SamplingConfig) -> list[Generation]: ...
