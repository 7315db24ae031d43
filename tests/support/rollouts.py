"""Helpers for the rollout and proof tests: model folders (random or perturbed), engines, tampering."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import torch

from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.models.loader import embedded_config, embedded_model_dir, write_tokenizer_files
from intellect_node.protocol.rollout import RolloutRecord, sign_rollout
from intellect_node.protocol.signing import SigningKey

torch.set_num_threads(1)


def random_model(dst: Path, seed: int = 0) -> Path:
    """A freshly initialised model with the embedded model's architecture and tokenizer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(embedded_config()).float().save_pretrained(str(dst))  # type: ignore[no-untyped-call]  # in transformers
    write_tokenizer_files(dst)
    return dst


def noisy_model(dst: Path, std: float, seed: int = 0) -> Path:
    """The embedded model with N(0, std^2) added to every weight."""
    from safetensors.torch import load_file, save_file

    src = embedded_model_dir()
    shutil.copytree(src, dst, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    state = load_file(str(src / "model.safetensors"))
    noisy = {k: (v + std * torch.randn(v.shape, generator=g)).contiguous() for k, v in state.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def resign(record: RolloutRecord, key: SigningKey, **changes: object) -> RolloutRecord:
    """``record`` with ``changes`` applied and signed again by ``key`` (a cheating worker)."""
    return sign_rollout(msgspec.structs.replace(record, **changes), key)


def engine(model: Path | None = None) -> TorchEngine:
    return TorchEngine.from_dir(str(model) if model else None)
