"""`rp metrics`: a job's per-step metrics, one row per step (the latest attempt's value)."""

from __future__ import annotations

import typer
from rich.table import Table

from ._app import app, get_client, handle_errors, print_json, stdout

_COLUMNS = ("step", "attempt", "train_loss", "valid_loss", "learning_rate", "tokens_per_second")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


@app.command()
@handle_errors
def metrics(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    last: int = typer.Option(0, "--last", "-n", help="Only the last N steps (0: all)."),
    json_lines: bool = typer.Option(False, "--json", help="One JSON row per step."),
) -> None:
    """Show a job's metrics per step; a step trained again after a resume shows its latest
    attempt's values (the daemon keeps one row per step)."""
    columns = get_client(ctx).jobs.metrics(job_id).columns
    names = [n for n in _COLUMNS if n in columns] + [n for n in columns if n not in _COLUMNS]
    count = len(columns.get("step", []))
    rows = [
        {n: (columns[n][i] if i < len(columns[n]) else None) for n in names} for i in range(count)
    ]
    if last > 0:
        rows = rows[-last:]
    if json_lines:
        for row in rows:
            print_json(row)
        return
    table = Table(box=None, header_style="bold")
    for name in names:
        table.add_column(name.upper().replace("_", " "), justify="right")
    for row in rows:
        table.add_row(*(_cell(row[n]) for n in names))
    stdout().print(table)
