"""Following a job on the terminal: a live bar (step/total, loss, tokens/s, ETA) or JSON lines."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from .._client import Client
from ..models import Event, Job
from ._app import print_json, printable


def _fmt_eta(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or seconds < 0:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def _loss_text(data: dict[str, Any]) -> str:
    """The bar's loss field; a DPO step adds its reward accuracy and margin (TRL's
    rewards/accuracies and rewards/margins), a GRPO step its mean reward (and the held-out
    one of its last evaluation)."""
    text = _fmt_num(data.get("train_loss"), ".4f")
    if isinstance(data.get("rewards/accuracies"), int | float):
        text += f" acc {data['rewards/accuracies']:.2f}"
        text += f" margin {_fmt_num(data.get('rewards/margins'), '+.3f')}"
    if isinstance(data.get("reward_mean"), int | float):
        text += f" reward {data['reward_mean']:.3f}"
        if isinstance(data.get("valid_reward_mean"), int | float):
            text += f" held-out {data['valid_reward_mean']:.3f}"
    return text


def _samples_text(event: Event) -> str:
    """A sample event as lines: the step, then each prompt and its completion (line breaks
    and control characters escaped, so each sample stays on one line)."""
    data = event.data or {}
    lines = [f"{event.job_id}: samples at step {data.get('step', '?')}"]
    for sample in data.get("samples") or []:
        if isinstance(sample, dict):
            prompt, completion = str(sample.get("prompt", "")), str(sample.get("completion", ""))
            lines.append(f"  {printable(prompt)} -> {printable(completion)}")
    return "\n".join(lines)


def _describe(event: Event) -> str | None:
    """The line printed above the bar for an event, or None to keep it quiet."""
    data = event.data or {}
    if event.type == "status":
        previous = data.get("previous")
        arrow = f"{previous} -> " if previous else ""
        return f"{event.job_id}: {arrow}{data.get('status', '?')}"
    if event.type == "checkpoint":
        return f"{event.job_id}: checkpoint at step {data.get('step', '?')}"
    if event.type == "sample":
        return _samples_text(event)
    if event.type == "metrics":
        if data.get("valid_loss") is not None:
            return f"{event.job_id}: step {data.get('step')} valid loss {data['valid_loss']:.4f}"
        return None
    if not event.message or (event.type == "log" and event.level == "info"):
        return None
    if event.type == "message" and event.level == "info" and "status" in data:
        return None  # the worker's own report of a transition the status events already show
    level = "" if event.level == "info" else f"{event.level}: "
    return f"{event.job_id}: {level}{printable(event.message)}"


def follow_job(client: Client, job_id: str, *, json_lines: bool = False) -> Job:
    """Shows the job's events until it ends; returns the final job."""
    if json_lines:
        for event in client.jobs.follow(job_id):
            print_json(event.model_dump(mode="json"))
        return client.jobs.get(job_id)

    job = client.jobs.get(job_id)
    metrics = job.metrics or {}
    console = Console(file=sys.stderr, highlight=False)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("ETA {task.fields[eta]}"),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(
            job_id,
            total=job.progress.total_steps,
            completed=job.progress.step,
            loss=_loss_text(metrics),
            tps=_fmt_num(metrics.get("tokens_per_second"), ",.0f"),
            eta=_fmt_eta(job.progress.eta_seconds),
        )
        for event in client.jobs.follow(job_id):
            data = event.data or {}
            if event.type == "metrics" and data.get("step") is not None:
                update: dict[str, Any] = {"completed": data["step"]}
                if data.get("total_steps"):
                    update["total"] = data["total_steps"]
                if data.get("train_loss") is not None:
                    update["loss"] = _loss_text(data)
                if data.get("tokens_per_second") is not None:
                    update["tps"] = _fmt_num(data["tokens_per_second"], ",.0f")
                if "eta_seconds" in data:
                    update["eta"] = _fmt_eta(data["eta_seconds"])
                progress.update(task, **update)
            line = _describe(event)
            if line:
                progress.console.print(line, markup=False)
    return client.jobs.get(job_id)


def report_outcome(job: Job) -> None:
    """One closing line: where the model is, or why the job did not succeed."""
    if job.status == "succeeded":
        # a LoRA job's output folder is the PEFT adapter (the merged model, if any, inside)
        lora = (job.spec.get("train") or {}).get("method") == "lora"
        label = "adapter" if lora else "model"
        where = f"; {label}: {job.output_model_path}" if job.output_model_path else ""
        sys.stdout.write(f"{job.id} succeeded{where}\n")
    elif job.status == "failed":
        reason = job.error.message if job.error else "no reason given"
        sys.stderr.write(f"{job.id} failed: {reason}\n")
    else:
        sys.stderr.write(f"{job.id} {job.status}\n")
