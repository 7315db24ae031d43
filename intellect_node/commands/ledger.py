"""``intellect-node ledger``: what this node submitted and what the validators said about it.

Reads ``<data-dir>/ledger.sqlite`` directly (read-only; SQLite WAL allows it while the node runs), so
it works whether the node is up or not.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.config.ledger import Ledger


def _when(ts: float | None) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def register(app: typer.Typer) -> None:
    @app.command("ledger")
    def ledger(
        data_dir_opt: Optional[Path] = DataDirOption,
        as_json: bool = typer.Option(False, "--json",
                                     help="Print one JSON object (summary and recent batches)."),
        run: Optional[str] = typer.Option(None, "--run", help="Only this run ID."),
        recent: int = typer.Option(10, "--recent", min=0, max=10_000,
                                   help="How many recent batches to list."),
    ) -> None:
        """Reconcile your work: batches submitted, rollouts accepted/rejected and why, batches still pending.

        Every batch is recorded before it is published, every verdict before it is acted on.
        """
        with Ledger.in_data_dir(data_dir(data_dir_opt), readonly=True) as led:
            summary = led.summary(run_id=run)
            rows = [r for r in led.recent(recent) if run is None or r["run_id"] == run] if recent else []
        if as_json:
            typer.echo(json.dumps({"path": str(led.path), "summary": summary.to_dict(), "recent": rows}))
            return
        from rich.console import Console
        from rich.table import Table

        console = Console()
        rate = summary.acceptance_rate
        console.print(f"[bold]ledger[/] {led.path}  runs: {', '.join(summary.runs) or '-'}")
        console.print(
            f"batches submitted [bold]{summary.batches_submitted}[/] ({summary.rollouts_submitted} rollouts, "
            f"{summary.tokens_submitted} tokens), pending a verdict [bold]{summary.batches_pending}[/]")
        console.print(
            f"rollouts accepted [green]{summary.rollouts_accepted}[/], "
            f"rejected [red]{summary.rollouts_rejected}[/]"
            f", acceptance {'-' if rate is None else f'{rate:.1%}'}  ({summary.verdicts_received} verdicts, "
            f"{_when(summary.first_at)} .. {_when(summary.last_at)})")
        if summary.unknown_batch_verdicts:
            console.print(f"[yellow]{summary.unknown_batch_verdicts} verdicts name batches this ledger "
                          "never recorded[/]")
        if summary.rejection_reasons:
            console.print("rejections by reason: " + ", ".join(
                f"{k} {v}" for k, v in summary.rejection_reasons.items()))
        if rows:
            table = Table("submitted", "batch", "policy", "rollouts", "accepted", "rejected", "reasons",
                          title="recent batches", title_justify="left")
            for r in rows:
                verdict_cols = ((str(r["accepted"]), str(r["rejected"])) if r["verdicts"]
                                else ("pending", ""))
                table.add_row(_when(r["submitted_at"]), r["batch_id"][:16], str(r["policy_version"]),
                              str(r["n_rollouts"]), *verdict_cols, r["reasons"] or "")
            console.print(table)
