"""Options and helpers shared by the command modules."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import typer

from intellect_node.errors import ConfigError
from intellect_node.p2p.identity import resolve_data_dir

if TYPE_CHECKING:
    from intellect_node.config.schema import RLConfig
    from intellect_node.envs.tasks import Task

DataDirOption = typer.Option(
    None, "--data-dir", "-d",
    help="Node data directory (key, blobs, ledger). Default: $INTELLECT_NODE_DATA_DIR, else the "
         "platform's user data directory.",
)


# The node's own options, one declaration each: every command that takes them says the same thing.
NodeConfigOption = typer.Option(
    None, "--config", "-c",
    help="The node's TOML config (see docs/config.example.toml). Default: $INTELLECT_NODE_CONFIG, else "
         "<data-dir>/config.toml if present; INTELLECT_NODE_<SECTION>__<FIELD> variables and flags "
         "override it.",
)
ListenOption = typer.Option(
    [], "--listen", "-l",
    help="libp2p listen multiaddr (repeatable). Default /ip4/127.0.0.1/tcp/0; use /ip4/0.0.0.0/tcp/4001 "
         "to be reachable from other machines.",
)
BootstrapOption = typer.Option(
    [], "--bootstrap", "-b",
    help="Peer to dial, /ip4/.../tcp/.../p2p/12D3KooW... (repeatable; in place of the config's "
         "network.bootstrap).",
)
LogLevelOption = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR.")
LogFileOption = typer.Option(None, "--log-file", help="Write logs here instead of stderr.")


def data_dir(value: Optional[Path]) -> Path:
    return resolve_data_dir(value)


@contextmanager
def data_dir_lock(d: Path) -> Iterator[None]:
    """Hold the node's data-dir lock while a command works on the store without a node: a node that is
    starting must not share it with us. ConfigError (exit 2) when a node holds it."""
    import fcntl
    import os

    from intellect_node.node.runtime import LOCK_FILE

    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ConfigError(f"a node is starting with --data-dir {d}; retry when `intellect-node status` "
                              "answers", field="data_dir") from exc
        yield
    finally:
        os.close(fd)



CONFIG_HELP = ("A node config file: use its run's task ([rl] env, env_args, tasks_file, task, answer "
               "extraction, system prompt) and run.model, so the figures are the run's.")


def task_and_model(config_path: Optional[Path], *, task_id: str, tasks_file: Optional[Path],
                   model_dir: Optional[Path], filtered: bool) -> tuple[Task, Optional[Path], RLConfig | None]:
    """``(task, model folder or None for the embedded one, the run's rl settings or None)`` for a model
    command (``tasks solve-rates``, ``proofs calibrate``).

    With ``--config`` the task is the run's own (``roles.common.tasks.run_task``, what its workers and
    validators build: reward environment, extraction, system prompt), and the model is ``run.model``
    unless ``--model`` is given. ``--task``/``--tasks`` beside ``--config`` would name two tasks, so that
    is refused (exit 2). ``filtered``: apply the run's offline solve-rate filter."""
    if config_path is None:
        if tasks_file is not None:
            from intellect_node.envs.jsonl_tasks import load_jsonl_tasks

            return load_jsonl_tasks(tasks_file), model_dir, None
        from intellect_node.envs.tasks import get_task

        return get_task(task_id), model_dir, None
    if tasks_file is not None or task_id != "add3":
        raise ConfigError("--config takes the task from the run's [rl] settings; drop --task/--tasks, "
                          "or drop --config", field="config")
    if not config_path.is_file():
        raise ConfigError(f"--config: no file at {config_path}; pass the run's node config (TOML)",
                          field="config")
    from intellect_node.config.loader import load_config
    from intellect_node.roles.common.tasks import run_task

    cfg = load_config(config_path)
    model = model_dir if model_dir is not None else (Path(cfg.run.model) if cfg.run.model else None)
    return run_task(cfg, filtered=filtered), model, cfg.rl


def parse_env_args(text: str | None) -> dict[str, object]:
    """``--env-args``: a JSON object (``'{"max_digits": 1}'``) or ``key=value`` pairs separated by commas
    (values read as JSON where they parse, else as strings)."""
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--env-args is not valid JSON ({exc}); e.g. --env-args "
                              "'{\"max_digits\": 1}' or --env-args max_digits=1,max_terms=2",
                              field="--env-args") from exc
        if not isinstance(doc, dict):
            raise ConfigError("--env-args must be a JSON object", field="--env-args")
        return doc
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--env-args: {part!r} is not key=value; e.g. --env-args "
                              "max_digits=1,max_terms=2", field="--env-args")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw.strip()
    return out
