"""`rp download` and `rp checkpoints`: a job's checkpoints and its trained model."""

from __future__ import annotations

import sys

import typer
from rich.table import Table

from ._app import EXIT_USAGE, app, fail, get_client, handle_errors, print_json, stdout


@app.command()
@handle_errors
def checkpoints(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    json_lines: bool = typer.Option(False, "--json", help="One JSON checkpoint per line."),
) -> None:
    """List a job's checkpoints."""
    listed = get_client(ctx).checkpoints.list(job_id)
    if json_lines:
        for checkpoint in listed:
            print_json(checkpoint.model_dump(mode="json"))
        return
    table = Table(box=None, header_style="bold")
    for column in ("STEP", "SIZE", "TRAIN LOSS", "PATH"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS", "STEP", "PATH"))
    for c in listed:
        loss = c.metrics.get("train_loss")
        table.add_row(
            str(c.step),
            f"{c.size_bytes:,}" if c.size_bytes is not None else "-",
            f"{loss:.4f}" if isinstance(loss, int | float) else "-",
            c.path or "-",
        )
    stdout().print(table)


@app.command()
@handle_errors
def download(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    step: int = typer.Option(None, "--step", help="Checkpoint step (default: the latest)."),
    # a str, not a Path: Path drops the trailing slash that names a folder to create
    output: str = typer.Option(
        None, "--output", "-o", help="File, or folder (an existing one, or one ending in /)."
    ),
    model_path: bool = typer.Option(
        False, "--model-path", help="Print where the trained model is instead of downloading."
    ),
) -> None:
    """Download a checkpoint as a tar file, or print the trained model's path."""
    client = get_client(ctx)
    if model_path:
        job = client.jobs.get(job_id)
        if not job.output_model_path:
            raise fail(f"{job_id} has no trained model yet (status {job.status})", EXIT_USAGE)
        sys.stdout.write(f"{job.output_model_path}\n")
        return
    if step is None:
        listed = client.checkpoints.list(job_id)
        if not listed:
            job = client.jobs.get(job_id)
            if job.output_model_path:
                # No checkpoint to send, but the final model is on the daemon's disk.
                sys.stdout.write(f"{job.output_model_path}\n")
                return
            raise fail(f"{job_id} has no checkpoint yet (status {job.status})", EXIT_USAGE)
        step = listed[-1].step
    path = client.checkpoints.download(job_id, step, output)
    sys.stdout.write(f"{path}\n")
