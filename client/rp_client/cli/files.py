"""`rp upload` and `rp files`: datasets on the daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.table import Table

from ._app import app, get_client, handle_errors, print_json, stdout


@app.command()
@handle_errors
def upload(
    ctx: typer.Context,
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="A jsonl dataset."),
    format: str = typer.Option(
        None, "--format", help="text | chat | prompt_completion | preference"
    ),
    json_lines: bool = typer.Option(False, "--json", help="The file object as JSON."),
) -> None:
    """Upload a dataset; prints its file id (use it as `data.train` in a spec)."""
    file = get_client(ctx).files.upload(path, format=format)
    if json_lines:
        print_json(file.model_dump(mode="json"))
    else:
        sys.stdout.write(f"{file.id}\n")


@app.command()
@handle_errors
def files(
    ctx: typer.Context,
    delete: str = typer.Option(None, "--delete", metavar="FILE", help="Delete this file."),
    json_lines: bool = typer.Option(False, "--json", help="One JSON file per line."),
) -> None:
    """List uploaded files (or delete one with --delete)."""
    client = get_client(ctx)
    if delete:
        client.files.delete(delete)
        sys.stdout.write(f"{delete} deleted\n")
        return
    listed = list(client.files.list())
    if json_lines:
        for file in listed:
            print_json(file.model_dump(mode="json"))
        return
    table = Table(box=None, header_style="bold")
    for column in ("ID", "FILENAME", "FORMAT", "LINES", "BYTES"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS", "STEP", "PATH"))
    for file in listed:
        table.add_row(
            file.id,
            file.filename,
            file.format or "-",
            str(file.line_count or "-"),
            f"{file.bytes:,}",
        )
    stdout().print(table)
