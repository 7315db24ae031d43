"""``intellect-node proofs``: calibrate the validator's thresholds from honest rollouts.

Where calibration writes: ``--out FILE``, else the ``--model`` folder's ``proof_thresholds.json`` (what
validators of that model read). It never writes into the installed package: the embedded model's
thresholds ship with it and every validator of a run must use the same ones, so a local recalibration
there would silently change this machine's verdicts (and be lost on upgrade). For the embedded model
without ``--out`` it stops before calibrating and says how to proceed (:func:`thresholds_target`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import typer

from intellect_node.commands.common import CONFIG_HELP, task_and_model
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.envs.tasks import Problem


def thresholds_target(model_dir: Optional[Path], out: Optional[Path]) -> Path:
    """The file calibration will update; ConfigError (exit 2) when that would be inside the package."""
    if out is not None:
        return out
    import intellect_node
    from intellect_node.models.loader import resolve_model_dir
    from intellect_node.proofs.thresholds import THRESHOLDS_FILE

    folder = resolve_model_dir(model_dir)
    package = Path(intellect_node.__file__).resolve().parent
    if folder.resolve().is_relative_to(package):
        raise ConfigError(
            f"the thresholds in {folder} ship with intellect-node and are not overwritten; "
            "pass --out FILE to write the calibration elsewhere, or export the model "
            "(`intellect-node model export DIR`) and calibrate --model DIR, whose proof_thresholds.json "
            "validators of that model read", field="out")
    return folder / THRESHOLDS_FILE


def register(app: typer.Typer) -> None:
    proofs = typer.Typer(help="TOPLOC, logprob and sampling checks: calibration.", no_args_is_help=True)

    @proofs.command("calibrate")
    def calibrate(
        model_dir: Optional[Path] = typer.Option(None, "--model", help="Model folder (default: embedded)."),
        dtype: str = typer.Option("float32", "--dtype", help="The run's dtype (thresholds are per dtype)."),
        n: int = typer.Option(64, "--n", help="Honest rollouts per engine and batch size."),
        batch_sizes: str = typer.Option("1,32", "--batch-sizes", help="Comma-separated batch sizes."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens",
                                                     help="Default: the run's rl.max_new_tokens with "
                                                          "--config, else 32."),
        temperature: Optional[float] = typer.Option(None, "--temperature",
                                                    help="Default: the run's rl.temperature with --config, "
                                                         "else 1.0."),
        top_p: float = typer.Option(1.0, "--top-p"),
        engine_names: str = typer.Option("torch", "--engines", help="Engines whose honest rollouts are "
                                         "verified: torch, vllm (comma-separated)."),
        factor: float = typer.Option(2.0, "--factor", help="Margin: threshold = worst * factor + floor."),
        out: Optional[Path] = typer.Option(None, "--out", help="Thresholds file to update (default: the "
                                           "--model folder's proof_thresholds.json; required for the "
                                           "embedded model, whose shipped file is never overwritten)."),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("cpu", "--device", help="Device the engines generate on (cpu, cuda, "
                                   "cuda:N): thresholds are per engine pair, engine@device -> torch@device."),
        verify_device: str = typer.Option("cpu", "--verify-device",
                                          help="Device of the verifier's prefill (the validators')."),
        config_path: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP),
        task_id: str = typer.Option("add3", "--task", help="Task whose prompts are generated from "
                                    "(default: the embedded add3; --config: the run's)."),
        tasks_file: Optional[Path] = typer.Option(None, "--tasks", help="A JSONL task file instead of "
                                                  "--task."),
    ) -> None:
        """Generate honest rollouts, verify them, and write thresholds with margins for this dtype, one
        entry per engine pair (engine@device -> torch@verify-device)."""
        try:
            sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise ConfigError("--batch-sizes must be positive integers, e.g. 1,32", field="batch_sizes")
        task, model_dir, rl = task_and_model(config_path, task_id=task_id, tasks_file=tasks_file,
                                             model_dir=model_dir, filtered=True)
        # The completions' lengths shape the figures as much as the prompts: the run's own by default.
        if max_new_tokens is None:
            max_new_tokens = rl.max_new_tokens if rl is not None else 32
        if temperature is None:
            temperature = rl.temperature if rl is not None else 1.0
        path = thresholds_target(model_dir, out)  # before minutes of calibration, not after
        # The run's prompts (chat template, system prompt, lengths) set the hidden states the proofs
        # compare, so the thresholds are calibrated on the task's own problems.
        default_task = config_path is None and tasks_file is None and task_id == "add3"
        problems = None if default_task else task.sample(random.Random(seed), n)  # None: as before
        calibrate_into(path, model_dir, problems, dtype=dtype, n=n, batch_sizes=sizes,
                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       engine_names=engine_names, factor=factor, seed=seed, device=device,
                       verify_device=verify_device, echo=typer.echo)
        from intellect_node.proofs.thresholds import file_sha256

        typer.echo(f"wrote {path} (sha256 {file_sha256(path)}: the run's proof_thresholds_sha256)")

    app.add_typer(proofs, name="proofs")


def calibrate_into(path: Path, model_dir: Optional[Path], problems: Optional[list[Problem]], *, dtype: str,
                   n: int, batch_sizes: list[int], max_new_tokens: int, temperature: float,
                   top_p: float = 1.0, engine_names: str = "torch", factor: float = 2.0, seed: int = 0,
                   device: str = "cpu", verify_device: str = "cpu", echo: Callable[[str], object]) -> None:
    """Generate honest rollouts of ``problems`` (None: the embedded addition prompts) with each engine,
    verify them and merge thresholds with margins into ``path``, one entry per engine pair
    (engine@device -> torch@verify_device); ``echo`` gets the table. ConfigError for a bad device or
    engine name."""
    import torch

    from intellect_node.config.schema import check_device
    from intellect_node.fsutil import atomic_write_text
    from intellect_node.inference import make_engine
    from intellect_node.inference.base import InferenceEngine, SamplingConfig
    from intellect_node.inference.calibrate import calibrate as run
    from intellect_node.inference.torch_engine import TorchEngine
    from intellect_node.proofs.thresholds import Margins, merge_into

    for flag, value in (("device", device), ("verify_device", verify_device)):
        try:
            check_device(value)
        except ValueError as exc:
            raise ConfigError(f"--{flag.replace('_', '-')}: {exc}", field=flag) from exc
    torch.set_num_threads(1)
    verifier_engine = TorchEngine.from_dir(model_dir, dtype=dtype, device=verify_device)
    engines: list[InferenceEngine] = []
    for name in [x.strip() for x in engine_names.split(",") if x.strip()]:
        if name == "torch" and device == verify_device:
            engines.append(verifier_engine)
        elif name in ("torch", "vllm"):
            engines.append(make_engine(verifier_engine.loaded.path, name, dtype=dtype, device=device))
        else:
            raise ConfigError(f"--engines: unknown engine {name!r} (torch, vllm)", field="engines")
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    cals = run(verifier_engine, engines, n=n, batch_sizes=batch_sizes, seed=seed,
               margins=Margins(factor=factor), sampling=sampling, problems=problems)
    for cal in cals:
        atomic_write_text(path, json.dumps(merge_into(path, cal), indent=2) + "\n")
        data = cal.to_json()
        echo(f"{cal.key}")
        echo(f"  {'check':18} {'worst honest':>14} {'threshold':>12}")
        for k, v in data["thresholds"].items():
            echo(f"  {k:18} {data['observed'][k]:>14.6g} {v:>12.6g}")
        echo(f"  {data['observed']['rollouts']} honest rollouts")
