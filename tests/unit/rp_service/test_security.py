"""Issue 33 in-process: the data-directory lock, the upload limit, a worker start re-queued."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram

from rp_service.app import _AuthState, _Guard
from rp_service.datadir import DataDir, DataDirLocked
from rp_service.jobs import orchestrator as orchestrator_module
from rp_service.jobs.events import EventHub
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.store import JobRecord, Store
from rp_service.settings import Settings


def test_one_claim_per_data_directory_and_a_private_token(tmp_path: Path) -> None:
    first = DataDir(tmp_path / "data")
    first.claim()
    try:
        with pytest.raises(DataDirLocked) as info:
            DataDir(tmp_path / "data").claim()
        assert info.value.pid == os.getpid() and f"pid {os.getpid()}" in str(info.value)
        token = first.token()
        assert token == first.token()  # made once, then read
        assert stat.S_IMODE(first.token_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(first.path.stat().st_mode) == 0o700
    finally:
        first.release()
    again = DataDir(tmp_path / "data")
    again.claim()  # released: the next daemon gets it
    again.release()


def _scope(path: str, method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"host", b"127.0.0.1:8321"), (b"authorization", b"Bearer t")],
    }


def test_uploads_past_the_limit_are_429_before_their_body_is_read(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, max_concurrent_uploads=2)
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()  # an upload still arriving
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    latency = Histogram("t", "t", ["method", "route", "status"], registry=CollectorRegistry())
    guard = _Guard(app, settings=settings, auth=_AuthState(True, b"t"), latency=latency)

    async def call(path: str) -> tuple[int, dict]:
        sent: list[dict] = []

        async def receive() -> dict:
            raise AssertionError("a refused upload's body is never read")

        async def send(message: dict) -> None:
            sent.append(message)

        await guard(_scope(path), receive, send)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], json.loads(body) if body else {}

    async def scenario() -> None:
        running = [asyncio.create_task(call("/v1/files")) for _ in range(2)]
        await asyncio.sleep(0.05)
        status, body = await call("/v1/files")
        assert status == 429 and body["error"]["code"] == "too_many_uploads"
        release.set()
        assert [(await t)[0] for t in running] == [201, 201]
        release.clear()
        later = asyncio.create_task(call("/v1/files"))  # the count went back down
        await asyncio.sleep(0.05)
        release.set()
        assert (await later)[0] == 201

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (errno.EMFILE, "queued", None),
        (errno.EAGAIN, "queued", None),
        (errno.ENOSPC, "failed", "disk_full"),
    ],
)
def test_a_worker_that_cannot_start_for_a_moment_is_requeued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, status: str, code: str | None
) -> None:
    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    settings = Settings(data_dir=tmp_path, gpus="none")
    orchestrator = Orchestrator(settings, store, EventHub())
    spec = {
        "model": {"preset": "qwen3"},
        "data": {"train": "synthetic"},
        "train": {"steps": 2},
        "engine": {"gpus": 0},
    }
    store.create_job(JobRecord(id="job-e", status="queued", created_at=0, spec=spec))

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(orchestrator_module.asyncio, "create_subprocess_exec", refuse)

    async def scenario() -> None:
        job = store.get_job("job-e")
        assert job is not None
        await orchestrator._launch(job, [])

    asyncio.run(scenario())
    job = store.get_job("job-e")
    assert job is not None and job.status == status
    assert (job.error or {}).get("code") == code
    assert orchestrator._cpu_jobs == 0 and not orchestrator._workers  # the slot is free
    if status == "queued":
        assert job.attempt == 0  # not counted: the worker never ran
        last = store.list_events("job-e")[-1]
        assert "re-queued" in last.message and last.level == "warning"
    store.close()


def test_the_engine_version_is_known() -> None:
    from rp_service import __version__
    from rp_service.system import SystemProbe

    versions = SystemProbe(probe_cuda=False).versions
    assert versions["engine"] == __version__  # the engine ships in this distribution
    assert versions["rp_service"] == __version__
