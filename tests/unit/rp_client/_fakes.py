"""Builders of daemon answers (jobs, events, SSE bodies, errors) for MockTransport tests."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

_CLIENT_DIR = Path(__file__).resolve().parents[3] / "client"
if str(_CLIENT_DIR) not in sys.path:
    sys.path.insert(0, str(_CLIENT_DIR))

BASE = "http://rp.test"


def job_obj(job_id: str = "job-1", status: str = "queued", **extra: Any) -> dict[str, Any]:
    job = {
        "id": job_id,
        "object": "job",
        "name": "demo",
        "status": status,
        "created_at": 1795000000,
        "started_at": None,
        "finished_at": None,
        "priority": 0,
        "attempt": 1,
        "spec": {"train": {"steps": 3}},
        "progress": {"step": 0, "total_steps": 3, "epoch": 0.0, "eta_seconds": None},
        "metrics": {},
        "trained_tokens": 0,
        "output_model_path": None,
        "gpus": [],
        "error": None,
    }
    job.update(extra)
    return job


def event_obj(event_id: int, job_id: str = "job-1", type: str = "metrics", **data: Any) -> dict:
    return {
        "id": event_id,
        "object": "event",
        "job_id": job_id,
        "created_at": 1795000000 + event_id,
        "level": "info",
        "type": type,
        "message": f"event {event_id}",
        "data": data or {"step": event_id, "total_steps": 3, "train_loss": 1.0 / event_id},
    }


def sse_body(events: list[dict], *, done: str | None = None, retry_ms: int | None = 3000) -> bytes:
    parts = [f"retry: {retry_ms}\n\n"] if retry_ms is not None else []
    for event in events:
        parts.append(f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n")
    if done:
        parts.append(f"event: done\ndata: {json.dumps({'job_id': 'job-1', 'status': done})}\n\n")
    return "".join(parts).encode()


def error_response(status: int, type: str, message: str, **extra: Any) -> httpx.Response:
    body = {
        "error": {
            "type": type,
            "code": extra.pop("code", type),
            "message": message,
            "param": extra.pop("param", None),
            "details": extra.pop("details", None),
        }
    }
    return httpx.Response(status, json=body, headers=extra.pop("headers", None))


class Recorder:
    """Routes requests to a handler and keeps each request for assertions."""

    def __init__(self, handler: Callable[[httpx.Request], httpx.Response]) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)
