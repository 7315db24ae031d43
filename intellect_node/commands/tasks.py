"""``intellect-node tasks``: the run's problems, and INTELLECT-2's offline filter over them.

``tasks solve-rates`` samples each problem of a pool several times with the starting policy and writes
``{problem_id: solve rate}``; a run that sets ``rl.solve_rates_file`` to it (and ``rl.solve_rate_band``,
default 0.1-0.8) trains only on the problems inside the band, and its validators reject rollouts of any
other problem. The file is JSON, so it can be pinned and shared like the task file itself.

Measuring takes about a minute on the embedded model and far longer on a real one, so it reports
progress (``commands/progress.py``) in problems measured of the pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from intellect_node.errors import ConfigError


class _Counting:
    """The engine as ``solve_rates`` sees it, counting the completions it asks for.

    ``solve_rates`` draws its batches and sampling keys itself; counting at the engine seam reports its
    progress without changing which completions it draws (the rates stay those of one call)."""

    def __init__(self, engine: Any, on_done: Any) -> None:
        self._engine = engine
        self._on_done = on_done
        self.completions = 0
        self.loaded = engine.loaded

    def generate(self, prompts: Any, keys: Any, sampling: Any) -> Any:
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
        max_new_tokens: int = typer.Option(5, "--max-new-tokens", help="The run's rl.max_new_tokens."),
        band: tuple[float, float] = typer.Option((0.1, 0.8), "--band", help="Band to report (the run's "
                                                 "rl.solve_rate_band)."),
        seed: int = typer.Option(0, "--seed"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
    ) -> None:
        """Measure each problem's solve rate with the starting policy (INTELLECT-2's offline filter)."""
        import random

        import torch

        from intellect_node.commands.progress import Progress
        from intellect_node.inference.evaluate import solve_rates as measure
        from intellect_node.inference.torch_engine import TorchEngine
        from intellect_node.trainer.filtering import SolveRateBand, save_solve_rates
        from intellect_node.trainer.tasks import get_task

        if samples < 2:
            raise ConfigError("--samples must be at least 2 (a rate from one draw is 0 or 1)",
                              field="samples")
        if pool < 1:
            raise ConfigError("--pool must be at least 1", field="pool")
        keep = SolveRateBand(*band)
        torch.set_num_threads(1)
        if tasks_file is not None:
            from intellect_node.trainer.jsonl_tasks import load_jsonl_tasks

            task = load_jsonl_tasks(tasks_file)
        else:
            task = get_task(task_id)
        n = min(pool, len(task))
        problems = ([task.problem(i) for i in range(n)] if n == len(task)
                    else task.sample(random.Random(seed), n))
        problems = list({p.problem_id: p for p in problems}.values())  # a sampled pool may repeat
        with Progress("tasks solve-rates", quiet=quiet) as progress:
            progress.phase("loading the model")
            engine = TorchEngine.from_dir(model_dir)
            progress.phase("measuring", total=len(problems), unit="problems", samples=samples)
            counting = _Counting(engine, lambda n: progress.update(n // samples))
            rates = measure(counting, problems, samples,  # type: ignore[arg-type]  # duck-typed seam
                            max_new_tokens=max_new_tokens, seed=seed)
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
