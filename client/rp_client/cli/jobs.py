"""`rp submit`, `jobs`, `status`, `follow`, `cancel`, `pause`, `resume`, `rm`, `logs`."""

from __future__ import annotations

import itertools
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from ..models import Job, ParameterCounts, load_spec_file
from ._app import (
    app,
    get_client,
    handle_errors,
    job_exit_code,
    print_json,
    printable,
    stdout,
)
from .progress import follow_job, report_outcome


def _when(ts: int | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _steps(job: Job) -> str:
    total = job.progress.total_steps
    return f"{job.progress.step}/{total}" if total else str(job.progress.step)


def _parameters(counts: ParameterCounts, spec: dict[str, Any]) -> str:
    method = (spec.get("train") or {}).get("method") or "full"
    quantization = (spec.get("model") or {}).get("quantization") or "none"
    text = (
        f"{counts.trainable:,} trainable of {counts.total:,} "
        f"({100 * counts.trainable_fraction:.2f}%, {method})"
    )
    if counts.base_host_bytes is not None:
        packed = ", nf4" if quantization == "nf4" else ""
        text += f"; base {counts.base_host_bytes / 2**20:,.1f} MiB on the host{packed}"
    return text


def _finish(ctx: typer.Context, job: Job, follow: bool, json_lines: bool) -> None:
    client = get_client(ctx)
    if not follow:
        return
    job = follow_job(client, job.id, json_lines=json_lines)
    if not json_lines:
        report_outcome(job)
    raise typer.Exit(job_exit_code(job))


@app.command()
@handle_errors
def submit(
    ctx: typer.Context,
    spec: Path = typer.Argument(..., help="Job spec, YAML or JSON (see docs/API.md)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Follow the job to its end."),
    name: str = typer.Option(None, "--name", help="Override the spec's name."),
    json_lines: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Submit a job from a spec file; prints its id."""
    try:
        body = load_spec_file(spec)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise typer.BadParameter(str(exc), param_hint="SPEC") from None
    if name:
        body["name"] = name
    job = get_client(ctx).jobs.create(body)
    if json_lines:
        print_json(job.model_dump(mode="json"))
    else:
        sys.stdout.write(f"{job.id}\n")
    _finish(ctx, job, follow, json_lines)


@app.command()
@handle_errors
def jobs(
    ctx: typer.Context,
    status: str = typer.Option(None, "--status", help="Only jobs in this state."),
    limit: int = typer.Option(20, "--limit", "-n", help="At most this many (0: all)."),
    json_lines: bool = typer.Option(False, "--json", help="One JSON job per line."),
) -> None:
    """List jobs, newest first."""
    listed = get_client(ctx).jobs.list(status=status, page_size=min(limit, 100) or 100)
    selected = list(itertools.islice(listed, limit or None))
    if json_lines:
        for job in selected:
            print_json(job.model_dump(mode="json"))
        return
    table = Table(box=None, header_style="bold")
    for column in ("ID", "NAME", "STATUS", "STEP", "LOSS", "CREATED"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS", "STEP", "PATH"))
    for job in selected:
        loss = job.metrics.get("train_loss")
        table.add_row(
            job.id,
            escape(printable(job.name or "-")),  # a table cell is rich markup otherwise
            job.status,
            _steps(job),
            f"{loss:.4f}" if isinstance(loss, int | float) else "-",
            _when(job.created_at),
        )
    stdout().print(table)


@app.command()
@handle_errors
def status(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    json_lines: bool = typer.Option(False, "--json", help="The job object as JSON."),
) -> None:
    """Show one job."""
    job = get_client(ctx).jobs.get(job_id)
    if json_lines:
        print_json(job.model_dump(mode="json"))
        return
    lines = [
        ("id", job.id),
        ("name", printable(job.name or "-")),
        ("status", job.status),
        ("step", _steps(job)),
        ("attempt", str(job.attempt)),
        ("restarts", str(job.restarts)),
        ("created", _when(job.created_at)),
        ("started", _when(job.started_at)),
        ("finished", _when(job.finished_at)),
        ("trained tokens", f"{job.trained_tokens:,}"),
    ]
    if job.parameters is not None:
        lines.append(("parameters", _parameters(job.parameters, job.spec)))
    if job.gpu_mode is not None:
        ranks = f" x {job.gpu_mode.ranks}" if job.gpu_mode.mode == "ranks" else ""
        overlap = ", calls overlapped" if job.gpu_mode.overlap_calls else ""
        text = f"{job.gpu_mode.mode}{ranks}{overlap}: {job.gpu_mode.reason}"
        lines.append(("gpu mode", printable(text)))
    lines += [(k, f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in job.metrics.items()]
    if job.progress.eta_seconds is not None and not job.is_terminal:
        lines.append(("eta", f"{job.progress.eta_seconds:.0f} s"))
    if job.output_model_path:
        lines.append(("model", job.output_model_path))
    if job.error:
        param = f" ({job.error.param})" if job.error.param else ""
        code = f"[{job.error.code}] " if job.error.code else ""
        lines.append(("error", printable(f"{code}{job.error.message}{param}")))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        sys.stdout.write(f"{key:<{width}}  {value}\n")


@app.command()
@handle_errors
def follow(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    json_lines: bool = typer.Option(False, "--json", help="One JSON event per line."),
) -> None:
    """Follow a job to its end with a live progress bar (exit 1 unless it succeeds)."""
    job = follow_job(get_client(ctx), job_id, json_lines=json_lines)
    if not json_lines:
        report_outcome(job)
    raise typer.Exit(job_exit_code(job))


def _transition(ctx: typer.Context, job_id: str, action: str, json_lines: bool) -> None:
    job = getattr(get_client(ctx).jobs, action)(job_id)
    if json_lines:
        print_json(job.model_dump(mode="json"))
    else:
        sys.stdout.write(f"{job.id} {job.status}\n")


@app.command()
@handle_errors
def cancel(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    json_lines: bool = typer.Option(False, "--json"),
) -> None:
    """Cancel a job."""
    _transition(ctx, job_id, "cancel", json_lines)


@app.command()
@handle_errors
def pause(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    json_lines: bool = typer.Option(False, "--json"),
) -> None:
    """Pause a job: it checkpoints and releases its GPUs."""
    _transition(ctx, job_id, "pause", json_lines)


@app.command()
@handle_errors
def resume(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    json_lines: bool = typer.Option(False, "--json"),
) -> None:
    """Resume a paused job from its checkpoint."""
    _transition(ctx, job_id, "resume", json_lines)


@app.command()
@handle_errors
def rm(
    ctx: typer.Context,
    job_ids: list[str] = typer.Argument(..., metavar="JOB..."),
    json_lines: bool = typer.Option(False, "--json"),
) -> None:
    """Delete finished jobs with their checkpoints, outputs and logs."""
    client = get_client(ctx)
    for job_id in job_ids:
        deleted = client.jobs.delete(job_id)
        if json_lines:
            print_json(deleted.model_dump(mode="json"))
        else:
            sys.stdout.write(f"{deleted.id} deleted\n")


@app.command()
@handle_errors
def logs(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    offset: int = typer.Option(0, "--offset", help="Start at this byte."),
) -> None:
    """Print the job worker's log."""
    client = get_client(ctx)
    if follow:
        for text in client.jobs.follow_logs(job_id, offset=offset):
            sys.stdout.write(text)
            sys.stdout.flush()
        return
    sys.stdout.write(client.jobs.logs(job_id, offset=offset).text)
