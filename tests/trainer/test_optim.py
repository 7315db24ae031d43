"""CpuAdamW: torch.optim.AdamW's CPU update bit for bit, torch's state format both ways, no torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from intellect_node.trainer.model import load_trainable
from intellect_node.trainer.optim import CpuAdamW
from intellect_node.trainer.step import make_optimizer


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 5),
                               torch.nn.Linear(5, 3, bias=False))


def _grads(model: torch.nn.Sequential, step: int) -> None:
    """Gradients of a fixed loss; one parameter gets none on odd steps (skipped by both optimizers)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 11, (8,), generator=g)
    (model(x).pow(2).sum() * (step + 1)).backward()
    if step % 2:
        last = model[2]
        assert isinstance(last, torch.nn.Linear)
        last.weight.grad = None


def _run(model: torch.nn.Sequential, opt: object, steps: range) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]  # CpuAdamW or torch's AdamW
        _grads(model, step)
        opt.step()  # type: ignore[attr-defined]  # CpuAdamW or torch's AdamW


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_weights_are_bit_identical_to_torch_adamw_step_after_step(weight_decay: float) -> None:
    ours, theirs = _model(0), _model(0)
    opt_ours = CpuAdamW(ours.parameters(), 3e-3, betas=(0.8, 0.95), weight_decay=weight_decay)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=weight_decay)
    for step in range(12):
        _run(ours, opt_ours, range(step, step + 1))
        _run(theirs, opt_theirs, range(step, step + 1))
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p, q), f"step {step}: {name} differs"
    a, b = opt_ours.state_dict(), opt_theirs.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)
            assert a["state"][i][key].dtype == b["state"][i][key].dtype


@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_a_saved_state_resumes_bit_identically_in_the_other_implementation(direction: str,
                                                                           tmp_path: Path) -> None:
    first, resumed, reference = _model(1), _model(1), _model(1)
    make_first = (lambda p: torch.optim.AdamW(p, lr=1e-2)) if direction == "torch->ours" else \
        (lambda p: CpuAdamW(p, 1e-2))
    make_resumed = (lambda p: CpuAdamW(p, 5e-1)) if direction == "torch->ours" else \
        (lambda p: torch.optim.AdamW(p, lr=5e-1))
    opt = make_first(first.parameters())
    _run(first, opt, range(5))
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")  # what a checkpoint holds
    resumed.load_state_dict(first.state_dict())
    opt2 = make_resumed(resumed.parameters())
    opt2.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True, mmap=True))
    assert opt2.param_groups[0]["lr"] == 1e-2  # the saved group's settings, as torch does
    _run(resumed, opt2, range(5, 9))
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _run(reference, opt_ref, range(9))
    for a, b in zip(resumed.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_a_state_that_does_not_fit_the_model_is_refused_by_name_and_changes_nothing() -> None:
    model = _model(2)
    opt = CpuAdamW(model.parameters(), 1e-3)
    _run(model, opt, range(1))
    before = opt.state_dict()
    other = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="covers 2 parameters; the model has 4"):
        opt.load_state_dict(other.state_dict())
    bad = opt.state_dict()
    bad["state"][1] = {**bad["state"][1], "exp_avg": torch.zeros(3)}
    with pytest.raises(ValueError, match="parameter 1 has exp_avg of shape"):
        opt.load_state_dict(bad)
    amsgrad = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(amsgrad)
    after = opt.state_dict()
    for i in before["state"]:
        assert all(torch.equal(before["state"][i][k], after["state"][i][k]) for k in before["state"][i])


def test_the_trainer_gets_cpu_adamw_on_the_cpu_and_torch_adamw_when_asked() -> None:
    model = load_trainable(None)
    assert isinstance(make_optimizer(model, 1e-3), CpuAdamW)
    assert isinstance(make_optimizer(model, 1e-3, torch_optim=True), torch.optim.AdamW)


def test_a_cpu_trainer_steps_and_checkpoints_without_importing_torch_dynamo(tmp_path: Path) -> None:
    """The point of CpuAdamW: the first step's path and a checkpoint import no torch._dynamo (about 1 s)."""
    code = textwrap.dedent(f"""
        import sys
        import torch
        from intellect_node.trainer.checkpoint import TrainerState, save_checkpoint
        from intellect_node.trainer.grpo import GRPOConfig
        from intellect_node.trainer.model import load_trainable
        from intellect_node.trainer.step import Sample, make_optimizer, train_step
        model = load_trainable(None)
        opt = make_optimizer(model, 1e-3)
        samples = [Sample((5, 6), (7, 8), (-1.0, -1.2), float(i % 2)) for i in range(4)]
        train_step(model, opt, samples, GRPOConfig(group_size=4, token_budget=8))
        save_checkpoint({str(tmp_path)!r}, model, opt, TrainerState(version=1))
        assert opt.state, "the step made optimizer state"
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no dynamo"
