"""``intellect-node ledger``: what this node submitted, what the validators said about it, and what the
trainer's signed step records say it trained on (receipts, ``roles/common/receipts.py``); ``--all``: every
worker's trained rollouts, from the step records this node heard alone.

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
from intellect_node.config.ledger import BatchRow, Ledger


def _when(ts: float | None) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _receipt(row: BatchRow) -> str:
    """What the trainer's step records say of a batch: the step and version that trained on it, dropped
    and why, admitted and not yet trained (accepted, no record yet), dropped without a record (accepted,
    no record named it, and the records heard are past the version it could be trained at), or nothing
    (not accepted)."""
    outcome = row.get("trained_outcome")
    if outcome == "trained":
        return f"v{row['trained_version']} ({row['trained_groups']}/{row['groups']} groups)"
    if outcome:
        return f"dropped: {outcome}"
    if row["verdicts"] and not row["rejected"] and row["accepted"]:
        return "dropped without a record" if row.get("past_bound") else "admitted, not yet trained"
    return ""


def register(app: typer.Typer) -> None:
    @app.command("ledger")
    def ledger(
        data_dir_opt: Optional[Path] = DataDirOption,
        as_json: bool = typer.Option(False, "--json",
                                     help="Print one JSON object (summary and recent batches)."),
        run: Optional[str] = typer.Option(None, "--run", help="Only this run ID."),
        recent: int = typer.Option(10, "--recent", min=0, max=10_000,
                                   help="How many recent batches to list."),
        every_worker: bool = typer.Option(False, "--all",
                                          help="Every worker's trained rollouts, from the trainer's step "
                                               "records this node heard."),
    ) -> None:
        """Reconcile your work: batches submitted, rollouts accepted/rejected and why, batches still pending.

        Every batch is recorded before it is published, every verdict before it is acted on.
        """
        with Ledger.in_data_dir(data_dir(data_dir_opt), readonly=True) as led:
            summary = led.summary(run_id=run)
            rows = [r for r in led.recent(recent) if run is None or r["run_id"] == run] if recent else []
            workers = led.trained_by_worker(run_id=run) if every_worker else []
        if as_json:
            out = {"path": str(led.path), "summary": summary.to_dict(), "recent": rows}
            if every_worker:
                out["workers"] = workers
            typer.echo(json.dumps(out))
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
        dropped = ", ".join(f"{k} {v}" for k, v in summary.batches_dropped.items()) or "none"
        console.print(f"trained on (step records) [bold]{summary.batches_trained}[/] batches "
                      f"({summary.rollouts_trained} rollouts), admitted and not yet trained "
                      f"{summary.batches_admitted_untrained}, dropped by the trainer: {dropped}")
        if summary.batches_unrecorded:
            console.print(f"[red]{summary.batches_unrecorded} accepted batches dropped without a record[/] "
                          "(no step record named them, though the trainer is past the version they could "
                          "be trained at)")
        if rows:
            table = Table("submitted", "batch", "policy", "rollouts", "accepted", "rejected", "reasons",
                          "trainer", title="recent batches", title_justify="left")
            for r in rows:
                verdict_cols = ((str(r["accepted"]), str(r["rejected"])) if r["verdicts"]
                                else ("pending", ""))
                table.add_row(_when(r["submitted_at"]), r["batch_id"][:16], str(r["policy_version"]),
                              str(r["n_rollouts"]), *verdict_cols, r["reasons"] or "", _receipt(r))
            console.print(table)
        if every_worker:
            wt = Table("worker", "batches trained", "rollouts trained", "equal rewards", "stale",
                       "last version", title="every worker (step records heard)", title_justify="left")
            for w in workers:
                wt.add_row(w["worker"], str(w["batches_trained"]), str(w["rollouts_trained"]),
                           str(w["equal_rewards"]), str(w["stale"]), str(w["last_version"]))
            console.print(wt)
