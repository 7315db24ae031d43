"""The trainer's own network (``trainer/lean.py``) against transformers, the reference: for every family
(tiny random models with each family's feature on, every tensor perturbed so biases and norm weights
matter), the same parameter names and shapes, the same logits on right- and left-padded batches and the
same gradients; bad folders refused with the tensor named; a trainer loading and stepping the embedded
model imports no transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from intellect_node.errors import ConfigError
from intellect_node.trainer.lean import LeanCausalLM
from intellect_node.trainer.model import TrainOptions, load_trainable
from tests.support.grpo import FAMILIES, tiny_family_model

torch.set_num_threads(1)

HF = TrainOptions(implementation="transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        model = tiny_family_model(family, seed=7, tied=family == "qwen2")
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():  # zero biases and unit norms would hide a missing term
                p += 0.05 * torch.randn(p.shape, generator=g)
        model.save_pretrained(path)
        out[family] = path
    return out


def _batch(left: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows of 4, 11 and 7 tokens padded to 11 with the pad ID 0 (Mistral's window of 8 is passed)."""
    g = torch.Generator().manual_seed(3)
    lengths, width = [4, 11, 7], 11
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    pos = torch.zeros(3, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[r, cols] = torch.randint(3, 32, (n,), generator=g)
        mask[r, cols] = 1
        pos[r, cols] = torch.arange(n)
    ids[1, 5] = 0  # a real token that is the pad ID: its embedding row gets no gradient, as in transformers
    return ids, mask, pos


@pytest.mark.parametrize("family", FAMILIES)
def test_same_parameters_logits_and_gradients_as_transformers(family: str, folders: dict[str, Path]) -> None:
    lean = load_trainable(folders[family])
    ref = load_trainable(folders[family], HF)
    assert isinstance(lean, LeanCausalLM) and type(ref).__module__.startswith("transformers.")
    shapes = {k: v.shape for k, v in ref.state_dict().items()}
    assert {k: v.shape for k, v in lean.state_dict().items()} == shapes
    assert [n for n, _ in lean.named_parameters()] == [n for n, _ in ref.named_parameters()]
    if family == "qwen2":  # tied: one tensor under both names, as transformers holds it
        assert lean.lm_head.weight is lean.model.embed_tokens.weight
    for left in (False, True):
        ids, mask, pos = _batch(left)
        real = mask.bool()
        a = lean(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        b = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert torch.allclose(a[real], b[real], atol=2e-5), (family, left, float((a - b)[real].abs().max()))
        # A loss over the real tokens only: gradients agree, and the pad rows add nothing (no NaN).
        weights = torch.randn(a.shape, generator=torch.Generator().manual_seed(5)) * real[..., None]
        for m, out in ((lean, a), (ref, b)):
            m.zero_grad()
            (out * weights).sum().backward()
        for (name, p), q in zip(lean.named_parameters(), ref.parameters()):
            assert p.grad is not None and torch.isfinite(p.grad).all(), (family, name)
            assert q.grad is not None
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), \
                (family, left, name, float((p.grad - q.grad).abs().max()))


def test_a_checkpoint_of_either_implementation_loads_into_the_other(folders: dict[str, Path]) -> None:
    lean = load_trainable(folders["qwen3"])
    ref = load_trainable(folders["qwen3"], HF)
    with torch.no_grad():
        for p in lean.parameters():
            p.mul_(1.5)
    ref.load_state_dict(lean.state_dict())
    ids, mask, pos = _batch(False)
    assert torch.allclose(lean(input_ids=ids).logits, ref(input_ids=ids).logits, atol=2e-5)


def test_folders_that_do_not_match_their_config_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    src = folders["llama"]
    state = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())

    def folder(name: str, tensors: dict[str, torch.Tensor], cfg: dict[str, object]) -> Path:
        path = tmp_path / name
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    gone = folder("gone", {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}, config)
    with pytest.raises(ConfigError, match=r"weights missing for 1 tensors.*layers\.1\.mlp\.up_proj\.weight"):
        load_trainable(gone)
    small = folder("small", state, {**config, "intermediate_size": 64})
    with pytest.raises(ConfigError, match=r"do not match config\.json.*gate_proj\.weight \(128, 64\) "
                                          r"\(config says \(64, 64\)\)"):
        load_trainable(small)
    dropout = folder("dropout", state, {**config, "attention_dropout": 0.1})
    with pytest.raises(ConfigError, match="attention_dropout = 0.1 .*set it to 0.0"):
        load_trainable(dropout)
    with pytest.raises(ConfigError, match="lean, transformers"):
        TrainOptions(implementation="jax")
    # Derived tensors some checkpoints carry are ignored, not refused.
    extra = folder("extra", {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, config)
    assert isinstance(load_trainable(extra), LeanCausalLM)


def test_the_trainers_start_imports_no_transformers() -> None:
    """The point of the lean network: a trainer loading the embedded model and taking a GRPO step never
    imports transformers (about 2 s of one core on this machine)."""
    code = """
import sys, torch
from intellect_node.roles.trainer import role  # the node role, as `join --role trainer` imports it
from intellect_node.trainer.grpo import GRPOConfig
from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.step import Sample, make_optimizer, train_step
model = load_trainable(None)
samples = [Sample((1, 5, 6), (7, 8), (-1.0, -2.0), float(i % 2)) for i in range(4)]
stats = train_step(model, make_optimizer(model, 1e-3), samples, GRPOConfig(group_size=4, token_budget=8))
assert stats.grad_norm > 0
print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
