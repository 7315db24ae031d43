"""``intellect-node tasks``: the run's problems, and INTELLECT-2's offline filter over them.

``tasks solve-rates`` samples each problem of a pool several times with the starting policy and writes
``{problem_id: solve rate}``; a run that sets ``rl.solve_rates_file`` to it (and ``rl.solve_rate_band``,
default 0.1-0.8) trains only on the problems inside the band, and its validators reject rollouts of any
other problem. The file is JSON, so it can be pinned and shared like the task file itself.

Measuring takes about a minute on the embedded model and far longer on a real one, so it reports
progress (``commands/progress.py``) in problems measured of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from intellect_node.commands.common import CONFIG_HELP, task_and_model
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.inference.base import Generation, SamplingConfig
    from intellect_node.inference.torch_engine import TorchEngine


class _Counting:
    """The engine as ``solve_rates`` sees it, counting the completions it asks for.

    ``solve_rates`` draws its batches and sampling keys itself; counting at the engine seam reports its
    progress without changing which completions it draws (the rates stay those of one call)."""

    def __init__(self, engine: TorchEngine, on_done: Callable[[int], object]) -> None:
        self._engine = engine
        self._on_done = on_done
        self.completions = 0
        self.loaded = engine.loaded

    def generate(self, prompts: Sequence[Sequence[int]], keys: Sequence[int],
                 sampling: SamplingConfig) -> list[Generation]:
        out = self._engine.generate(prompts, keys, sampling)
        self.completions += len(prompts)
        self._on_done(self.completions)
        return out


def register(app: typer.Typer) -> None:
    tasks = typer.Typer(help="Tasks and the offline solve-rate filter.", no_args_is_help=True)

    @tasks.command("solve-rates")
    def solve_rates(
        out: Path = typer.Option(..., "--out", help="Where to write the {problem_id: solve rate} JSON."),
        task_id: str = typer.Option("add3", "--task", help="Task ID (the embedded task: add3)."),
        tasks_file: Optional[Path] = typer.Option(None, "--tasks",
                                                  help="A JSONL task file instead of --task."),
        model_dir: Optional[Path] = typer.Option(None, "--model",
                                                 help="The starting policy (default: embedded)."),
        samples: int = typer.Option(16, "--samples", help="Completions per problem."),
        pool: int = typer.Option(1024, "--pool", help="Problems to measure (all of them when the task is "
                                 "smaller); drawn with --seed."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="The run's "
                                                     "rl.max_new_tokens (default: --config's, else 5)."),
        band: Optional[tuple[float, float]] = typer.Option(None, "--band", help="Band to report (the "
                                                           "run's rl.solve_rate_band; default: --config's, "
                                                           "else 0.1 0.8)."),
        seed: int = typer.Option(0, "--seed"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
        config_path: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP),
    ) -> None:
        """Measure each problem's solve rate with the starting policy (INTELLECT-2's offline filter)."""
        import random

        import torch

        from intellect_node.commands.progress import Progress
        from intellect_node.envs.filtering import SolveRateBand, save_solve_rates
        from intellect_node.inference.evaluate import solve_rates as measure
        from intellect_node.inference.torch_engine import TorchEngine

        if samples < 2:
            raise ConfigError("--samples must be at least 2 (a rate from one draw is 0 or 1)",
                              field="samples")
        if pool < 1:
            raise ConfigError("--pool must be at least 1", field="pool")
        torch.set_num_threads(1)
        task, model_dir, rl = task_and_model(config_path, task_id=task_id, tasks_file=tasks_file,
                                             model_dir=model_dir, filtered=False)
        if max_new_tokens is None:
            max_new_tokens = rl.max_new_tokens if rl is not None else 5
        if band is None:
            band = rl.solve_rate_band if rl is not None else (0.1, 0.8)
        keep = SolveRateBand(*band)
        n = min(pool, len(task))
        problems = ([task.problem(i) for i in range(n)] if n == len(task)
                    else task.sample(random.Random(seed), n))
        problems = list({p.problem_id: p for p in problems}.values())  # a sampled pool may repeat
        with Progress("tasks solve-rates", quiet=quiet) as progress:
            progress.phase("loading the model")
            engine = TorchEngine.from_dir(model_dir)
            progress.phase("measuring", total=len(problems), unit="problems", samples=samples)
            counting = _Counting(engine, lambda n: progress.update(n // samples))
            rates = measure(counting, problems, samples, max_new_tokens=max_new_tokens, seed=seed)
        save_solve_rates(out, rates)
        values = sorted(rates.values())
        kept = sum(1 for r in values if r in keep)
        never = sum(1 for r in values if r == 0.0)
        always = sum(1 for r in values if r == 1.0)
        typer.echo(f"{len(values)} problems of {task.task_id}, {samples} samples each: mean solve rate "
                   f"{sum(values) / len(values):.3f}; never solved {never}, always solved {always}; "
                   f"{kept} inside {keep.low}-{keep.high}")
        typer.echo(f"wrote {out}; set rl.solve_rates_file = \"{out}\" (and rl.solve_rate_band) "
                   "in the run config")

    app.add_typer(tasks, name="tasks")
