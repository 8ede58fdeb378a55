"""Issue 33 on the client side: the local token file, `rp rm`, escaped names."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from rp_client import AsyncClient, Client, TooManyRequests
from rp_client.cli import app
from typer.testing import CliRunner

from ._fakes import error_response, job_obj

HOSTILE = "\x1b[2J\x1b[31mred[bold]x\u202e"


def _page(*jobs: dict) -> dict:
    return {"object": "list", "data": list(jobs), "has_more": False}


def _run(make_client, handler, *args: str):
    client, rec = make_client(handler, max_retries=0)
    result = CliRunner().invoke(app, list(args), obj={"client": client})
    return result, rec.requests


def test_rp_jobs_and_status_escape_control_characters(make_client) -> None:
    job = job_obj(name=HOSTILE)
    listed, _ = _run(make_client, lambda r: httpx.Response(200, json=_page(job)), "jobs")
    shown, _ = _run(make_client, lambda r: httpx.Response(200, json=job), "status", "job-1")
    for result in (listed, shown):
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\u202e" not in result.output
        assert "\\x1b[2J\\x1b[31mred[bold]x\\u202e" in result.output  # markup kept literal


def test_rp_rm_deletes_each_job(make_client) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        job_id = request.url.path.rsplit("/", 1)[-1]
        if job_id == "job-running":
            return error_response(409, "conflict_error", "job job-running is running")
        return httpx.Response(200, json={"id": job_id, "object": "job", "deleted": True})

    result, requests = _run(make_client, handler, "rm", "job-a", "job-b")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["job-a deleted", "job-b deleted"]
    assert [(r.method, r.url.path) for r in requests] == [
        ("DELETE", "/v1/jobs/job-a"),
        ("DELETE", "/v1/jobs/job-b"),
    ]
    refused, _ = _run(make_client, handler, "rm", "job-running")
    assert refused.exit_code == 2 and "running" in refused.output


def test_async_delete_and_429(make_async_client) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={"id": "job-1", "object": "job", "deleted": True})
        return error_response(429, "rate_limit_error", "queue full", code="queue_full")

    async def scenario() -> None:
        client, _ = make_async_client(handler, max_retries=0)
        async with client:
            assert (await client.jobs.delete("job-1")).deleted
            with pytest.raises(TooManyRequests):
                await client.jobs.create({"model": {"preset": "qwen3"}})

    asyncio.run(scenario())


def _sent_token(client: Client) -> str | None:
    return client._default_headers().get("Authorization")


def test_the_local_daemons_token_file_is_read_for_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RP_TOKEN", raising=False)
    monkeypatch.setenv("RP_DATA_DIR", str(tmp_path))
    with Client("http://127.0.0.1:8321") as local:
        assert _sent_token(local) is None  # no file yet: asked again on the next request
        (tmp_path / "token").write_text("made-by-the-daemon\n")
        assert _sent_token(local) == "Bearer made-by-the-daemon"
    with Client("http://localhost:9", token_file=tmp_path / "token") as named:
        assert _sent_token(named) == "Bearer made-by-the-daemon"
    with Client("http://gpu-box.example:8321") as remote:
        assert _sent_token(remote) is None
    with Client("http://127.0.0.1:8321", token="given") as explicit:
        assert _sent_token(explicit) == "Bearer given"
    with Client("http://127.0.0.1:8321", token="") as anonymous:
        assert _sent_token(anonymous) is None
    monkeypatch.setenv("RP_TOKEN", "from-env")
    async_client = AsyncClient("http://127.0.0.1:8321")
    assert async_client._default_headers()["Authorization"] == "Bearer from-env"
