"""The worker protocol seen from the daemon: event lines in, store arguments and outcomes out."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.pipe import PAUSED_EXIT_CODE, WorkerHandle


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def test_metrics_update_progress_and_keep_the_last_valid_loss() -> None:
    w = WorkerHandle(job_id="job-1", gpus=[])
    first = w.read_line(
        _line(
            {
                "type": "metrics",
                "data": {
                    "step": 1,
                    "total_steps": 9,
                    "train_loss": 2.0,
                    "valid_loss": 3.0,
                    "trained_tokens": 64,
                },
            }
        )
    )
    second = w.read_line(_line({"type": "metrics", "data": {"step": 2, "train_loss": 1.5}}))
    assert first["job_fields"]["trained_tokens"] == 64
    assert second["job_fields"]["progress"]["step"] == 2
    assert second["job_fields"]["metrics"]["train_loss"] == 1.5
    assert second["job_fields"]["metrics"]["valid_loss"] == 3.0
    assert "trained_tokens" not in second["job_fields"]


def test_checkpoint_lines_carry_a_checkpoint_row() -> None:
    w = WorkerHandle(job_id="job-1", gpus=[])
    out = w.read_line(
        _line(
            {
                "type": "checkpoint",
                "message": "c",
                "data": {"step": 7, "path": "/c", "size_bytes": 9, "metrics": {"a": 1}},
            }
        )
    )
    row = out["checkpoint"]
    assert (row.job_id, row.step, row.path, row.size_bytes, row.metrics) == (
        "job-1",
        7,
        "/c",
        9,
        {"a": 1},
    )


def test_sample_lines_are_sample_events_with_their_attempt_and_no_job_fields() -> None:
    w = WorkerHandle(job_id="job-1", gpus=[], attempt=2)
    samples = [{"prompt": "hi", "completion": "there", "tokens": 5}]
    out = w.read_line(
        _line({"type": "sample", "message": "s", "data": {"step": 4, "samples": samples}})
    )
    assert out == {
        "type_": "sample",
        "level": "info",
        "message": "s",
        "data": {"step": 4, "samples": samples, "attempt": 2},
    }


def test_worker_status_reports_become_messages() -> None:
    w = WorkerHandle(job_id="job-1", gpus=[])
    out = w.read_line(
        _line({"type": "status", "data": {"status": "succeeded", "output_model_path": "/o"}})
    )
    assert out["type_"] == "message" and out["message"] == "worker: succeeded"
    assert w.succeeded and w.output_model_path == "/o"
    assert w.outcome(0) == ("succeeded", None)


def test_garbage_lines_are_logs_and_unknown_fields_are_sanitised() -> None:
    w = WorkerHandle(job_id="job-1", gpus=[])
    assert w.read_line(b"   \n") is None
    assert w.read_line(b"not json\n") == {
        "type_": "log",
        "level": "info",
        "message": "not json",
        "data": {},
    }
    out = w.read_line(_line({"type": "boom", "level": "fatal", "data": [1]}))
    assert (out["type_"], out["level"], out["data"]) == ("log", "info", {})
    assert w.read_line(b"\xff\xfe{\n")["type_"] == "log"


def test_exit_outcomes() -> None:
    w = WorkerHandle(job_id="job-1", gpus=[])
    assert w.outcome(PAUSED_EXIT_CODE) == ("paused", None)
    assert w.outcome(-signal.SIGKILL) == ("failed", "worker killed by signal 9 (SIGKILL)")
    assert w.outcome(0) == ("failed", "worker exited without reporting success")
    assert w.outcome(3)[1].startswith("worker exited with status 3")
    w.read_line(
        _line(
            {
                "type": "message",
                "level": "error",
                "message": "m",
                "data": {"message": "bad line 3", "param": "data.train"},
            }
        )
    )
    assert w.outcome(1) == ("failed", "bad line 3")
    w.pause_requested = True
    assert w.outcome(-signal.SIGUSR1) == ("paused", None)  # signalled before its handler existed
    w.cancel_requested = True
    assert w.outcome(-signal.SIGTERM) == ("cancelled", None)


def test_gpu_share_keeps_the_latest_metrics_events_and_maps_to_the_daemons_gpus() -> None:
    """A metrics event's gpu_share is kept per worker (bad items dropped, wrong types
    None); GET /v1/system's rows name each daemon GPU's job and what it reported for it
    (the worker saw GPUs 3 and 1 as cuda:0 and cuda:1)."""
    w = WorkerHandle(job_id="job-1", gpus=[3, 1])
    share = [
        {"device": "cuda:0", "busy_fraction": 0.9, "busy_s": 1.8, "jobs": 12},
        {"device": "cuda:1", "busy_fraction": "high", "jobs": True},
        {"busy_fraction": 0.5},
        "cuda:2",
    ]
    w.read_line(_line({"type": "metrics", "data": {"step": 7, "gpu_share": share}}))
    w.read_line(_line({"type": "metrics", "data": {"step": 8}}))  # none: the last one stays
    assert w.gpu_share_step == 7
    assert w.gpu_share == [
        {"device": "cuda:0", "busy_fraction": 0.9, "jobs": 12},
        {"device": "cuda:1", "busy_fraction": None, "jobs": None},
    ]
    cpu = WorkerHandle(job_id="job-2", gpus=[])
    cpu.read_line(
        _line(
            {
                "type": "metrics",
                "data": {"step": 1, "gpu_share": [{"device": "cpu-virtual:0", "jobs": 3}]},
            }
        )
    )
    daemon = SimpleNamespace(gpu_ids=[0, 1, 3], _workers={"job-1": w, "job-2": cpu})
    rows = Orchestrator.gpu_share(daemon)  # type: ignore[arg-type]
    assert rows == [
        {
            "gpu": 0,
            "device": "cuda:0",
            "job_id": None,
            "busy_fraction": None,
            "jobs": None,
            "step": None,
        },
        {
            "gpu": 1,
            "device": "cuda:1",
            "job_id": "job-1",
            "busy_fraction": None,
            "jobs": None,
            "step": 7,
        },
        {
            "gpu": 3,
            "device": "cuda:3",
            "job_id": "job-1",
            "busy_fraction": 0.9,
            "jobs": 12,
            "step": 7,
        },
        {
            "gpu": None,
            "device": "cpu-virtual:0",
            "job_id": "job-2",
            "busy_fraction": None,
            "jobs": 3,
            "step": 1,
        },
    ]
