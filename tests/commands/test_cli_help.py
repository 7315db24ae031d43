"""The help typer renders has no hard line breaks inside a sentence: rich wraps it to the terminal."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import typer.main
from typer.testing import CliRunner

from intellect_node.cli import app


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_no_command_help_paragraph_breaks_a_line() -> None:
    root = typer.main.get_command(app)
    broken = []
    for path, cmd in _commands(root):
        for para in inspect.cleandoc(cmd.help or "").split("\n\n"):
            lines = para.split("\n")
            if para.startswith("\b") or all(line.startswith((" ", "- ", "* ")) for line in lines[1:]):
                continue
            broken.append((" ".join(path), lines[0]))
    assert not broken


def test_top_level_help_shows_each_command_summary_on_one_line() -> None:
    root = typer.main.get_command(app)
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = result.output.splitlines()
    for name, cmd in getattr(root, "commands", {}).items():
        summary = inspect.cleandoc(cmd.help or "").split("\n\n")[0]
        assert any(summary in row for row in rows), (name, summary)
    assert any("75 when it stopped" in row for row in rows)
