"""The run's task, its assignment rule, and whether rollout records are work on it."""

from __future__ import annotations

from typing import Sequence

from intellect_node.config import NodeConfig
from intellect_node.config.status import clean_text
from intellect_node.envs.assignment import Assignments
from intellect_node.envs.heldout import HeldOutPart, Split, TrainingPart
from intellect_node.envs.tasks import Task
from intellect_node.errors import ConfigError
from intellect_node.protocol.rollout import RolloutRecord


def run_task(cfg: NodeConfig, *, filtered: bool = True) -> Task:
    """The run's task: the reward environment (``rl.env``), the JSONL file, or ``rl.task``, under the
    run's extraction and system-prompt settings and registered so its problem IDs resolve
    (``envs.environment.build_task``); narrowed to the offline filter's band when
    ``rl.solve_rates_file`` is set and ``filtered`` (``tasks solve-rates`` measures the whole task), and
    then, with ``run.eval_every`` on, to its training part: the held-out problems are never a worker's
    (:func:`eval_split`)."""
    from intellect_node.envs.environment import build_task

    rl = cfg.rl
    task: Task = build_task(task=rl.task, tasks_file=rl.tasks_file or None, env=rl.env or None,
                            env_args=dict(rl.env_args), answer_format=rl.answer_format, think=rl.think,
                            max_completion_chars=rl.max_completion_chars, system_prompt=rl.system_prompt,
                            reward_timeout_s=rl.reward_timeout_s)
    if filtered and cfg.rl.solve_rates_file:
        from intellect_node.envs.filtering import filter_by_rates_file

        task = filter_by_rates_file(task, cfg.rl.solve_rates_file, cfg.rl.solve_rate_band)
    split = eval_split(cfg, task) if filtered else None
    return split.training if split is not None else task


def eval_split(cfg: NodeConfig, task: Task) -> Split | None:
    """``task`` (the run's, after the offline filter) cut into its held-out and training parts when
    ``run.eval_every`` is on (``envs/heldout.py``); None when it is off."""
    if not cfg.run.eval_every:
        return None
    return Split(task, cfg.run.run_id, cfg.run.eval_problems)


def held_out_task(cfg: NodeConfig) -> HeldOutPart:
    """The run's held-out problems (``envs/heldout.py``); ConfigError naming ``run.eval_every`` when
    evaluation is off."""
    training = run_task(cfg)
    if not isinstance(training, TrainingPart):
        raise ConfigError("run.eval_every is 0: the run holds no problem out of training",
                          field="run.eval_every")
    return training.held_out


WINDOW_ROOM = 4
"""Assignment windows per version, in multiples of what a worker submits per version at most
(``batches_per_version * (1 + work_ahead)``): the rest is room for the batches it makes again while the
trainer finds no signal and makes no new version (``roles/worker/pacing.py``). A worker choosing among
its windows shows the ones it skipped (``envs.assignment.Coverage``); the fewer windows, the less it has
to choose from."""


def run_assignments(cfg: NodeConfig, task: Task) -> Assignments:
    """Which problems each worker of the run must submit (``envs/assignment.py``): from settings that are
    the same on every node of a run, so the worker, the validators and the trainer agree."""
    rl = cfg.rl
    per_version = rl.batches_per_version * (1 + rl.work_ahead)
    return Assignments(task, cfg.run.run_id, problems_per_batch=rl.problems_per_batch,
                       async_level=cfg.run.async_level, windows_per_version=WINDOW_ROOM * per_version)


def wrong_task(task: Task, records: Sequence[RolloutRecord]) -> str:
    """Why ``records`` are not all work on the run's ``task`` ("" when they are). Every registered task
    resolves its own problem IDs (the embedded ``add3`` always), so the verifier's lookup alone would
    accept another task's work: validators and the trainer check against the run's task first."""
    for r in records:
        if r.task_id != task.task_id:
            return f"a rollout of task {clean_text(r.task_id, 80)!r}; the run's task is {task.task_id!r}"
    for pid in dict.fromkeys(r.problem_id for r in records):
        try:
            task.get(pid)
        except ConfigError:
            return f"{clean_text(pid, 80)!r} is not a problem of the run's task {task.task_id!r}"
    return ""
