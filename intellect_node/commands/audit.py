"""``intellect-node audit calibrate``: the run's ``run.audit_tolerance`` from honest replays.

It samples honest steps of the run (its model, task and settings from ``--config``; the embedded model
and the default settings without it), trains them as the trainer does (``--trainer-threads``, 1 as the
trainer runs) and replays them under the auditor's condition (``--threads``), and prints the worst
difference seen and the tolerance with its margins (``roles/auditor/calibration.py``); ``--out FILE``
writes the calibration as JSON. Operator mistakes exit 2 naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from intellect_node.errors import ConfigError


def register(app: typer.Typer) -> None:
    audit = typer.Typer(help="Replay audits of the trainer's steps: calibration.", no_args_is_help=True)

    @audit.command("calibrate")
    def calibrate(
        config_path: Optional[Path] = typer.Option(None, "--config", help="The run's node config (TOML): "
                                                   "its model, task and [rl] settings (default: the "
                                                   "embedded model with the default settings)."),
        threads: int = typer.Option(..., "--threads", help="Torch threads of the auditor's replays (the "
                                    "condition that differs from the trainer's)."),
        trainer_threads: int = typer.Option(1, "--trainer-threads",
                                            help="Torch threads of the trainer (it runs with 1)."),
        steps: int = typer.Option(4, "--steps", help="Honest steps to observe (each a different step)."),
        factor: float = typer.Option(4.0, "--factor", help="Margin: tolerance = worst * factor + floor."),
        floor: float = typer.Option(1e-5, "--floor", help="Margin: the least tolerance."),
        seed: int = typer.Option(0, "--seed", help="Seed of the sampled rollouts."),
        out: Optional[Path] = typer.Option(None, "--out", help="Write the calibration (JSON) here too."),
    ) -> None:
        """Replay honest steps under the auditor's condition and print the run's audit tolerance."""
        for flag, value, least in (("--threads", threads, 1), ("--trainer-threads", trainer_threads, 1),
                                   ("--steps", steps, 1)):
            if value < least:
                raise ConfigError(f"{flag} must be at least {least}; got {value}", field=flag)
        if factor < 1.0 or not floor >= 0.0:
            raise ConfigError(f"--factor must be at least 1 and --floor at least 0; got {factor}, {floor}",
                              field="--factor" if factor < 1.0 else "--floor")
        if out is not None and not out.parent.is_dir():
            raise ConfigError(f"--out: no folder {out.parent}; create it or write elsewhere", field="--out")
        if config_path is not None and not config_path.is_file():
            raise ConfigError(f"--config: no file at {config_path}; pass the run's node config (TOML)",
                              field="--config")
        import torch

        from intellect_node.config.loader import build_config, load_config
        from intellect_node.fsutil import atomic_write_text
        from intellect_node.roles.auditor.calibration import calibrate_run, honest_steps
        from intellect_node.roles.auditor.tolerance import AuditMargins

        cfg = load_config(config_path) if config_path is not None else build_config({})
        torch.set_num_threads(1)
        samples = honest_steps(cfg, steps, seed=seed, echo=typer.echo)
        if not samples:
            raise ConfigError("no sampled step had a group with unequal rewards: nothing trains; raise "
                              "--steps or check the run's task (`intellect-node tasks solve-rates`)",
                              field="--steps")
        weights, moments = calibrate_run(cfg, samples, threads=threads, trainer_threads=trainer_threads,
                                         margins=AuditMargins(factor=factor, floor=floor))
        use = max(weights, moments, key=lambda c: c.tolerance)
        typer.echo(f"condition: {weights.condition}; {weights.steps} honest steps")
        for what, c in (("weights (of the update)", weights), ("optimizer state (of its norm)", moments)):
            typer.echo(f"  {what:30} worst {c.observed:.3g} in {c.worst_tensor or '-'} (max |diff| "
                       f"{c.max_abs:.3g}) -> {c.tolerance:.3g}")
        if use.observed == 0.0:
            typer.echo("every replay was bitwise: this condition needs no tolerance (0 keeps audits bitwise)")
        if use.tolerance >= 1.0:
            raise ConfigError(f"the honest replays differ by {use.observed:.3g}: no tolerance under 1 covers "
                              "this condition (bf16 autocast rounds more than a dishonest change moves; "
                              "docs/training.md, Audit)", field="--threads")
        if out is not None:
            doc = {"weights": weights.to_json(), "optimizer": moments.to_json(),
                   "audit_tolerance": use.tolerance}
            atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
            typer.echo(f"wrote {out}")
        typer.echo(f"[run]\naudit_tolerance = {use.tolerance:.6g}")

    app.add_typer(audit, name="audit")
