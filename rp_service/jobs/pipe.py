"""The worker protocol seen from the daemon: one worker's state, its job dir, its events.

`WorkerHandle.read_line` turns one stdout line into the arguments of `Store.append_event`
(with the job columns and checkpoint row the event implies) and remembers what the final
transition needs; `WorkerHandle.outcome` says what the exit status means.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from rp_service.child_env import child_env
from rp_service.durable import write_bytes
from rp_service.jobs.faults import MemoryWatch
from rp_service.jobs.outputs import GRPO_COLUMNS, PREFERENCE_COLUMNS
from rp_service.jobs.store import CheckpointRecord
from rp_service.schemas import JobSpec
from rp_service.settings import Settings

__all__ = [
    "PAUSED_EXIT_CODE",
    "WorkerHandle",
    "journal_path",
    "prepare_job_dir",
    "proc_start_time",
]

PAUSED_EXIT_CODE = 75
_EVENT_TYPES = {"status", "metrics", "checkpoint", "sample", "log", "message"}
_LEVELS = {"info", "warning", "error"}
_PROGRESS_KEYS = ("step", "total_steps", "epoch", "eta_seconds")
_METRIC_KEYS = ("train_loss", "valid_loss", "learning_rate", "grad_norm", "tokens_per_second")
_MESSAGE_CHARS = 4000
_GPU_SHARE_DEVICES = 64  # at most this many devices of a metrics event's gpu_share are kept

Outcome = Literal["cancelled", "succeeded", "paused", "failed"]


def proc_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot); None if gone or a zombie.

    A pid plus its start time names one process for good: pids are reused, start times not.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie holds no resources; nothing to kill
        return None
    return fields[19]


def journal_path(job_dir: Path, attempt: int) -> Path:
    """Where the worker of `attempt` also writes its events (see rp_service.jobs.journal)."""
    return job_dir / f"events-{attempt}.jsonl"


def prepare_job_dir(
    settings: Settings,
    *,
    job_id: str,
    job_dir: Path,
    attempt: int,
    spec: JobSpec,
    options: dict[str, Any],
    resolved: dict[str, Any],
    gpus: list[int],
) -> tuple[dict[str, str], IO[bytes]]:
    """Write spec.json, open worker.log for appending, build the worker's environment.

    `options` is the job's `EngineOptions.to_json()`, mapped from `spec` at submission: the
    worker takes it as it is instead of mapping the spec again.

    Blocking; returns the environment and the open log (the worker's stderr).
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "job_id": job_id,
        "attempt": attempt,
        "spec": spec.model_dump(mode="json"),
        "options": options,
        "resolved": resolved,
        "event_journal": str(journal_path(job_dir, attempt)),
    }
    # Durable: a daemon that dies right after the launch must not find half a spec on restart.
    write_bytes(job_dir / "spec.json", json.dumps(payload, indent=2).encode())
    log_file = (job_dir / "worker.log").open("ab")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log_file.write(f"--- rp_service: attempt {attempt} starting at {stamp}\n".encode())
    log_file.flush()
    # Not the daemon's secrets: a worker runs code from user-supplied model folders.
    env = child_env()
    if gpus:
        env["RP_DEVICES"] = "cuda"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    else:
        env["RP_DEVICES"] = f"cpu:{settings.cpu_devices}"
        env["CUDA_VISIBLE_DEVICES"] = ""
    # The daemon's GPU memory cap is the engine's default (engine.device reads it); a job's
    # engine.max_gpu_memory_gib is passed to RoundPipe itself and wins.
    env.pop("RP_GPU_MEMORY_GIB", None)
    if settings.gpu_memory_gib is not None:
        env["RP_GPU_MEMORY_GIB"] = repr(settings.gpu_memory_gib)
    return env, log_file


def _parameter_counts(value: Any) -> dict[str, int] | None:
    """`{trainable, total[, base_host_bytes]}` from a worker's status event, if well-formed."""
    if not isinstance(value, dict):
        return None
    counts = {k: value.get(k) for k in ("trainable", "total")}
    if "base_host_bytes" in value:  # workers before it did not report it
        counts["base_host_bytes"] = value["base_host_bytes"]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()):
        return counts
    return None


@dataclass(eq=False)
class WorkerHandle:
    """One worker process of a job and what its events told us so far."""

    job_id: str
    gpus: list[int]
    on_cluster: bool = False  # engine.nodes > 1: the process is rp_service.cluster.driver
    proc: asyncio.subprocess.Process | None = None
    cancel_requested: bool = False
    pause_requested: bool = False
    succeeded: bool = False
    output_model_path: str | None = None
    last_error: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    escalation: asyncio.Task[None] | None = None
    attempt: int = 0
    # The highest step an earlier attempt reported: steps up to it are trained again.
    replay_until: int = 0
    replay_noted: bool = False
    memory: MemoryWatch = field(default_factory=MemoryWatch)
    # The latest metrics event's `gpu_share` (devices as the worker names them) and its step.
    gpu_share: list[dict[str, Any]] = field(default_factory=list)
    gpu_share_step: int | None = None

    def send(self, sig: signal.Signals) -> None:
        """Signal the worker's whole process group, if it is still running."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def read_line(self, line: bytes) -> dict[str, Any] | None:
        """`Store.append_event` keyword arguments for one stdout line; None for a blank one.

        A line that is not a JSON object is kept as a `log` event. The daemon owns `status`
        events (data `{status, previous}`): the worker's status reports become `message`
        events and set what the final transition needs.
        """
        text = line.decode("utf-8", "replace").strip()
        if not text:
            return None
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return {"type_": "log", "level": "info", "message": text[:_MESSAGE_CHARS], "data": {}}
        type_ = obj.get("type") if obj.get("type") in _EVENT_TYPES else "log"
        level = obj.get("level") if obj.get("level") in _LEVELS else "info"
        message = str(obj.get("message") or "")[:_MESSAGE_CHARS]
        data = obj.get("data") if isinstance(obj.get("data"), dict) else {}
        out: dict[str, Any] = {"type_": type_, "level": level, "message": message, "data": data}
        if type_ == "metrics":
            data["attempt"] = self.attempt  # one value per step: the latest attempt's wins
            out["job_fields"] = self._metrics_fields(data)
        elif type_ == "sample":
            data["attempt"] = self.attempt  # a replayed step samples again: the latest wins
        elif type_ == "checkpoint" and isinstance(data.get("step"), int):
            out["checkpoint"] = CheckpointRecord(
                job_id=self.job_id,
                step=data["step"],
                created_at=int(time.time()),
                path=str(data.get("path", "")),
                size_bytes=int(data.get("size_bytes") or 0),
                metrics=data.get("metrics") if isinstance(data.get("metrics"), dict) else {},
            )
        elif type_ == "status":
            reported = data.get("status")
            counts = _parameter_counts(data.get("parameters"))
            if counts is not None:
                out["job_fields"] = {"parameters": counts}
            if reported == "succeeded":
                self.succeeded = True
                path = data.get("output_model_path")
                self.output_model_path = str(path) if path else None
            out["type_"] = "message"
            out["message"] = message or f"worker: {reported}"
        if level == "error":
            self.last_error = {
                "code": data.get("code") if isinstance(data.get("code"), str) else None,
                "message": str(data.get("message") or message or "the worker reported an error"),
                "param": data.get("param") if isinstance(data.get("param"), str) else None,
            }
            if isinstance(data.get("details"), dict):
                self.last_error["details"] = data["details"]
        return out

    def _metrics_fields(self, data: dict[str, Any]) -> dict[str, Any]:
        # Keep the last known value of a metric that this step did not report (valid_loss).
        for key in _METRIC_KEYS:
            if data.get(key) is not None or key not in self.metrics:
                self.metrics[key] = data.get(key)
        # A DPO step's TRL-named metrics (the Prometheus exporter reads them here); other
        # jobs' metrics do not get these keys.
        # A GRPO step's rewards likewise (valid_reward_mean kept from its last evaluation).
        for key in PREFERENCE_COLUMNS + GRPO_COLUMNS:
            if isinstance(data.get(key), int | float):
                self.metrics[key] = data[key]
        share = _gpu_share(data.get("gpu_share"))
        if share is not None:
            self.gpu_share = share
            self.gpu_share_step = data["step"] if isinstance(data.get("step"), int) else None
        progress = {k: data.get(k) for k in _PROGRESS_KEYS}
        progress["step"] = data["step"] if isinstance(data.get("step"), int) else 0
        fields: dict[str, Any] = {"progress": progress, "metrics": dict(self.metrics)}
        if isinstance(data.get("trained_tokens"), int):
            fields["trained_tokens"] = data["trained_tokens"]
        return fields

    def outcome(self, returncode: int) -> tuple[Outcome, str | None]:
        """The job state the exit means, and for a failure the reason people will read."""
        killed_by = -returncode if returncode < 0 else None
        if self.cancel_requested:
            return "cancelled", None
        if returncode == 0 and self.succeeded:
            return "succeeded", None
        if returncode == PAUSED_EXIT_CODE or (
            self.pause_requested and killed_by == signal.SIGUSR1
        ):  # SIGUSR1 before the worker's handler was installed: paused at its last checkpoint
            return "paused", None
        if self.last_error is not None:
            return "failed", str(self.last_error["message"])
        if killed_by is not None:
            try:
                name = signal.Signals(killed_by).name
            except ValueError:
                name = "unknown"
            return "failed", f"worker killed by signal {killed_by} ({name})"
        if returncode == 0:
            return "failed", "worker exited without reporting success"
        return (
            "failed",
            f"worker exited with status {returncode}; see GET /v1/jobs/{self.job_id}/logs",
        )


def _gpu_share(value: Any) -> list[dict[str, Any]] | None:
    """A metrics event's `gpu_share`, checked: `{device, busy_fraction, jobs}` per device
    (a value of the wrong type becomes None); None where the event has none."""
    if not isinstance(value, list):
        return None
    rows = []
    for item in value[:_GPU_SHARE_DEVICES]:
        if not isinstance(item, dict) or not isinstance(item.get("device"), str):
            continue
        fraction, jobs = item.get("busy_fraction"), item.get("jobs")
        rows.append(
            {
                "device": item["device"][:64],
                "busy_fraction": float(fraction)
                if isinstance(fraction, int | float) and not isinstance(fraction, bool)
                else None,
                "jobs": jobs if isinstance(jobs, int) and not isinstance(jobs, bool) else None,
            }
        )
    return rows
