"""Loading a trainable model: any supported causal-LM family from a local folder, in the training
precision and on the device the operator chose.

The trainer builds its network with this project's modules (``trainer/lean.py``) from ``config.json``
and the safetensors: the families' differences (Llama-3 rope scaling, Qwen2's QKV bias, Qwen3's q/k
norms, Mistral's sliding window, tied or untied embeddings, sharded safetensors) come from
``models.families``, as on the inference side. transformers' ``AutoModelForCausalLM`` (offline,
``local_files_only``) is the reference both are tested against, and ``implementation="transformers"``
(config ``rl.train_implementation``) trains on it instead; the lean one starts about 2 s sooner because
it imports none of transformers. Other ``model_type`` values are refused before any weights are read.

Precision (``dtype``):

- ``float32``: parameters, gradients and AdamW state in fp32 (the default; what the embedded model and
  the equality tests use).
- ``bfloat16``: the parameters stay fp32 and *are* the master weights, and the forward/backward runs
  under ``torch.autocast(bfloat16)`` (matmuls in bf16, reductions and the log-softmax of the loss in
  fp32). We chose autocast over bf16 parameters plus an fp32 copy because it needs no second copy of the
  weights to keep in sync, the optimizer and checkpoints see plain fp32 tensors (a bf16 run resumes in
  fp32 and back), and FSDP2's ``MixedPrecisionPolicy`` is the same scheme, so one-process and sharded
  steps agree. Memory per parameter is the same 16 bytes either way (fp32 weights 4 + grads 4 + AdamW
  8; the alternative holds bf16 weights 2 + bf16 grads 2 + fp32 master 4 + AdamW 8); activations are
  bf16 in both. Measured on this project's 2-core CPU (avx512_bf16; a 16.8M-parameter Qwen3, 8 x 128
  tokens, forward + backward, docs/training.md): fp32 1.97 s, autocast 0.77 s, bf16 parameters 0.66 s.
  The 15% autocast leaves on the table (casting the weights each forward) buys the simpler invariant.

``gradient_checkpointing`` recomputes each decoder layer's forward in the backward (non-reentrant
checkpointing): one more forward per step, for activation memory that no longer grows with depth.

Shortcut: the model is loaded whole on one device (FSDP2 shards it after loading, see
``distributed.py``); loading straight into shards (meta device) is not done.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager

import torch

from intellect_node.errors import ConfigError
from intellect_node.models.families import SUPPORTED_MODEL_TYPES

if TYPE_CHECKING:
    from intellect_node.policy.weights import PolicyWeights

TRAINABLE_MODEL_TYPES = SUPPORTED_MODEL_TYPES
"""The families the trainer trains: the same list the inference side runs (``models.families``)."""

TRAIN_DTYPES = ("float32", "bfloat16")
"""float16 is left out on purpose: without loss scaling its gradients underflow, and bf16 needs none."""

TRAIN_IMPLEMENTATIONS = ("lean", "transformers")

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class TrainOptions:
    """How the trainer holds and runs its model. Every node setting it reads is optional (default here)."""

    dtype: str = "float32"
    """``float32`` or ``bfloat16`` (fp32 master weights, bf16 compute under autocast)."""
    gradient_checkpointing: bool = False
    device: str = "cpu"
    """``cpu`` or ``cuda:N``."""
    micro_batch_tokens: int = 16384
    """Padded tokens (rows x longest row) per forward/backward; bounds activation memory whatever the
    completion lengths. 16k tokens of a 1-2B model fit a 24 GB accelerator with checkpointing on."""
    implementation: str = "lean"
    """``lean``: this project's modules (``trainer/lean.py``, no transformers import, ~2 s faster to
    start); ``transformers``: ``AutoModelForCausalLM``. Same parameters, same outputs (tested)."""

    def __post_init__(self) -> None:
        if self.dtype not in TRAIN_DTYPES:
            raise ConfigError(f"trainer dtype {self.dtype!r} is not one of {', '.join(TRAIN_DTYPES)}",
                              field="dtype")
        if not _DEVICE.match(self.device):
            raise ConfigError(f"trainer device {self.device!r} must be 'cpu' or 'cuda:N'", field="device")
        if self.implementation not in TRAIN_IMPLEMENTATIONS:
            raise ConfigError(f"trainer implementation {self.implementation!r} is not one of "
                              f"{', '.join(TRAIN_IMPLEMENTATIONS)}", field="train_implementation")
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens = {self.micro_batch_tokens} must be positive",
                              field="micro_batch_tokens")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype of the forward/backward, None for plain fp32."""
        return torch.bfloat16 if self.dtype == "bfloat16" else None

    @classmethod
    def from_section(cls, section: object) -> "TrainOptions":
        """Options from a config section that may carry ``train_dtype``, ``gradient_checkpointing``,
        ``train_device``, ``micro_batch_tokens`` and ``train_implementation`` (a section without them
        gets the defaults)."""
        d = cls()
        return cls(dtype=getattr(section, "train_dtype", d.dtype),
                   gradient_checkpointing=bool(getattr(section, "gradient_checkpointing",
                                                       d.gradient_checkpointing)),
                   device=getattr(section, "train_device", d.device),
                   micro_batch_tokens=int(getattr(section, "micro_batch_tokens", d.micro_batch_tokens)),
                   implementation=getattr(section, "train_implementation", d.implementation))


def autocast(model_or_device: torch.nn.Module | str | torch.device,
             compute_dtype: torch.dtype | None) -> ContextManager[Any]:
    """The autocast context of one forward/backward (a no-op in fp32)."""
    if compute_dtype is None:
        return contextlib.nullcontext()
    device = (model_or_device if isinstance(model_or_device, (str, torch.device))
              else model_device(model_or_device))
    return torch.autocast(device_type=torch.device(device).type, dtype=compute_dtype)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters live (FSDP2's DTensors report their local device)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def trainable_model_dir(model: str | Path | None) -> Path:
    """The model folder (None: the embedded model); ConfigError unless it holds a config and weights."""
    if model is None:
        from intellect_node.models.loader import embedded_model_dir

        return embedded_model_dir()
    path = Path(model).expanduser()
    weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    if not (path / "config.json").exists() or not weights:
        raise ConfigError(f"{path} is not a model folder for training (needs config.json and "
                          "model.safetensors or model.safetensors.index.json)", field="model")
    return path


def check_model_type(path: Path) -> str:
    """The folder's ``model_type``; ConfigError naming it when the trainer does not support it."""
    try:
        config = json.loads((path / "config.json").read_text())
        model_type = config.get("model_type") if isinstance(config, dict) else None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path / 'config.json'} is unreadable: {exc}", field="model") from exc
    if model_type not in TRAINABLE_MODEL_TYPES:
        raise ConfigError(f"{path}: model_type {model_type!r} cannot be trained; supported: "
                          f"{', '.join(TRAINABLE_MODEL_TYPES)}", field="model")
    return str(model_type)


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers 5 renamed the call)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_checkpointing(model: torch.nn.Module) -> bool:
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def load_trainable(model: str | Path | None = None, options: TrainOptions | None = None) -> torch.nn.Module:
    """The folder's model in fp32 on ``options.device``, in train mode, ready for ``train_step``.

    Weights are fp32 whatever the folder stores (bf16 checkpoints are upcast): they are the master
    weights the optimizer updates; ``options.dtype`` only changes the compute (see the module doc).
    ``options.implementation`` picks the network: this project's (``lean``) or transformers'.
    """
    options = options or TrainOptions()
    path = trainable_model_dir(model)
    check_model_type(path)
    if options.implementation == "lean":
        from intellect_node.models.loader import read_config, read_weights
        from intellect_node.trainer.lean import build

        m: torch.nn.Module = build(read_config(path), read_weights(path, "float32", options.device), path,
                                   options.device)
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
        hf.config.use_cache = False  # no KV cache while training (it is also incompatible with checkpointing)
        m = hf
    if options.gradient_checkpointing:
        enable_checkpointing(m)
    m.to(options.device)
    m.train()
    return m


def initial_policy(model: str | Path | None, dest: str | os.PathLike[str]) -> PolicyWeights:
    """Write version 0 of a run on ``model`` to ``dest``, as a fresh trainer publishes it: the weights
    :func:`load_trainable` gives (fp32, this project's network and its tensor names, which are
    transformers'), in the canonical policy format. Returns the file mapped (a ``PolicyWeights``).

    Followers build it from their own copy of the model folder and use it when its hash is the one the
    trainer announced (``roles/common/policy.py``), instead of fetching the whole checkpoint."""
    from intellect_node.policy.weights import PolicyWeights

    return PolicyWeights.write(dest, load_trainable(model, TrainOptions()).state_dict())


__all__ = ["TRAINABLE_MODEL_TYPES", "TRAIN_DTYPES", "TRAIN_IMPLEMENTATIONS", "TrainOptions", "autocast",
           "check_model_type", "enable_checkpointing", "initial_policy", "is_checkpointing", "load_trainable",
           "model_device", "trainable_model_dir"]
