"""Docs that state numbers the code defines say what the code says: the shipped proof thresholds and the
sample count they were calibrated on (docs/rollouts.md), `proofs calibrate`'s defaults, the demo's RL
settings and learning rate (docs/operators.md), and the embedded model's size as `model info` prints it.
Each number is read from where the code keeps it, formatted as the docs write it, and looked up in the
docs' text (line breaks folded to spaces)."""

from __future__ import annotations

import json
import re

import typer.main

from tests.support.cli import invoke_cli
from tests.support.common import REPO

MODEL = REPO / "intellect_node" / "assets" / "model"


def _doc(name: str) -> str:
    return re.sub(r"\s+", " ", (REPO / "docs" / name).read_text())


def test_rollouts_doc_states_the_shipped_thresholds_and_their_sample_count() -> None:
    entry = json.loads((MODEL / "proof_thresholds.json").read_text())["float32"]
    seen, th = entry["observed"], entry["thresholds"]
    doc = _doc("rollouts.md")
    expected = (
        f"calibrated on {seen['rollouts']} honest rollouts (engines {' and '.join(entry['engines'])}, "
        f"batch sizes {' and '.join(map(str, entry['batch_sizes']))}, {entry['max_new_tokens']} new tokens): "
        f"worst figures exp mismatches {seen['exp_mismatches']}, mantissa mean {seen['mant_err_mean']:.4f}, "
        f"mantissa median {seen['mant_err_median']:g}, logprob difference {seen['logprob_diff']:.2e} nats, "
        f"sampling gap {seen['sampling_gap']:g}; "
        f"thresholds (`worst * {entry['margins']['factor']:g} + floor`) "
        f"exp mismatches {th['exp_mismatches']}, mantissa mean {th['mant_err_mean']:.4f}, mantissa median "
        f"{th['mant_err_median']:g}, logprob difference {th['logprob_diff']:.2e} nats, sampling gap "
        f"{th['sampling_gap']:.2e}")
    assert expected in doc, expected


def test_rollouts_doc_states_calibrates_defaults() -> None:
    from intellect_node.cli import app

    proofs = typer.main.get_command(app).commands["proofs"]  # type: ignore[attr-defined]  # typer's group is a click Group
    params = {p.name: p.default for p in proofs.commands["calibrate"].params}
    assert f"[--n {params['n']}] [--batch-sizes {params['batch_sizes']}]" in _doc("rollouts.md")


def test_operators_doc_states_the_demos_rl_settings_and_learning_rate() -> None:
    from intellect_node.commands.demo import DEMO_RL

    expected = (f"{DEMO_RL['group_size']} samples per prompt, {DEMO_RL['problems_per_batch']} prompts per "
                f"worker batch, {DEMO_RL['groups_per_step']} groups per trainer step, "
                f"{DEMO_RL['max_new_tokens']} new tokens, lr {DEMO_RL['lr']:.0e}".replace("e-0", "e-"))
    assert expected in _doc("operators.md"), expected


def test_rollouts_doc_states_the_embedded_models_size_as_model_info_prints_it() -> None:
    r = invoke_cli("model", "info")
    assert r.returncode == 0, r.stderr
    fields = dict(ln.split(None, 1) for ln in r.stdout.splitlines() if len(ln.split(None, 1)) == 2)
    params = int(fields["parameters"].replace(",", ""))
    mib = re.search(r"\(([\d.]+ MiB)\)", fields["size_bytes"])
    assert mib, fields["size_bytes"]
    assert f"{params / 1e6:.2f}M parameters, {mib.group(1)} in fp32" in _doc("rollouts.md")
