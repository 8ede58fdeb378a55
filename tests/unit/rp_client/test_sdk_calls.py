"""Every SDK call sends the documented request and parses the documented answer."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile

import httpx
import pytest
from rp_client import Client, Event, File, Job, JobSpec, System

from ._fakes import BASE, event_obj, job_obj


def page(data, has_more=False):
    ids = [d.get("id") for d in data]
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": ids[0] if ids else None,
        "last_id": ids[-1] if ids else None,
    }


def test_base_url_and_token_come_from_arguments_then_environment(monkeypatch):
    monkeypatch.setenv("RP_URL", "http://env-host:9000/")
    monkeypatch.setenv("RP_TOKEN", "env-token")
    client = Client()
    assert client.base_url == "http://env-host:9000"
    assert client.token == "env-token"
    client = Client("http://arg:1", token="arg-token")
    assert (client.base_url, client.token) == ("http://arg:1", "arg-token")
    monkeypatch.delenv("RP_URL")
    monkeypatch.delenv("RP_TOKEN")
    client = Client()
    assert client.base_url == "http://127.0.0.1:8321"
    assert client.token is None


def test_token_is_sent_as_bearer(make_client):
    client, rec = make_client(lambda r: httpx.Response(200, json=job_obj()), token="s3cret")
    client.jobs.get("job-1")
    assert rec.requests[0].headers["Authorization"] == "Bearer s3cret"
    client, rec = make_client(lambda r: httpx.Response(200, json=job_obj()), token="")
    client.jobs.get("job-1")
    assert "Authorization" not in rec.requests[0].headers


@pytest.mark.parametrize("how", ["dict", "jobspec", "yaml", "json"])
def test_create_from_dict_jobspec_or_file(make_client, tmp_path, how):
    client, rec = make_client(lambda r: httpx.Response(201, json=job_obj(status="queued")))
    spec = {"name": "run", "train": {"steps": 5, "lr": 0.001}, "data": {"train": "synthetic"}}
    if how == "dict":
        arg = spec
    elif how == "jobspec":
        arg = JobSpec.model_validate(spec)
    elif how == "yaml":
        arg = tmp_path / "spec.yaml"
        arg.write_text("name: run\ntrain:\n  steps: 5\n  lr: 1.0e-3\ndata:\n  train: synthetic\n")
    else:
        arg = tmp_path / "spec.json"
        arg.write_text(json.dumps(spec))
    job = client.jobs.create(arg)
    assert isinstance(job, Job) and job.status == "queued"
    request = rec.requests[0]
    assert (request.method, request.url.path) == ("POST", "/v1/jobs")
    assert json.loads(request.content) == spec
    assert request.headers["Idempotency-Key"]


def test_create_sends_a_fresh_idempotency_key_unless_given(make_client):
    client, rec = make_client(lambda r: httpx.Response(201, json=job_obj()))
    client.jobs.create({})
    client.jobs.create({})
    client.jobs.create({}, idempotency_key="mine")
    keys = [r.headers["Idempotency-Key"] for r in rec.requests]
    assert keys[0] != keys[1] and keys[2] == "mine"


def test_jobspec_sends_only_what_was_set():
    spec = JobSpec(name="x", train={"steps": 2, "grad_clip": None})
    assert spec.to_body() == {"name": "x", "train": {"steps": 2, "grad_clip": None}}


def test_create_missing_spec_file_raises(make_client, tmp_path):
    client, _ = make_client(lambda r: httpx.Response(201, json=job_obj()))
    with pytest.raises(FileNotFoundError):
        client.jobs.create(tmp_path / "nope.yaml")


def test_list_iterates_all_pages(make_client):
    jobs = [job_obj(f"job-{i}") for i in range(5)]

    def handler(request):
        after = request.url.params.get("after")
        start = 0 if after is None else [j["id"] for j in jobs].index(after) + 1
        chunk = jobs[start : start + 2]
        return httpx.Response(200, json=page(chunk, has_more=start + 2 < len(jobs)))

    client, rec = make_client(handler)
    listed = list(client.jobs.list(status="queued", page_size=2))
    assert [j.id for j in listed] == [f"job-{i}" for i in range(5)]
    assert len(rec.requests) == 3
    assert rec.requests[0].url.params["status"] == "queued"
    assert rec.requests[0].url.params["limit"] == "2"
    assert rec.requests[1].url.params["after"] == "job-1"


def test_list_stops_when_the_server_ignores_the_cursor(make_client):
    client, rec = make_client(lambda r: httpx.Response(200, json=page([job_obj()], has_more=True)))
    assert len(list(client.jobs.list())) == 2
    assert len(rec.requests) == 2


@pytest.mark.parametrize("action", ["cancel", "pause", "resume"])
def test_lifecycle_actions_post_and_return_the_job(make_client, action):
    client, rec = make_client(lambda r: httpx.Response(200, json=job_obj(status="cancelling")))
    job = getattr(client.jobs, action)("job-1")
    assert job.status == "cancelling"
    assert (rec.requests[0].method, rec.requests[0].url.path) == (
        "POST",
        f"/v1/jobs/job-1/{action}",
    )


def test_get_events_metrics_and_logs(make_client):
    def handler(request):
        path = request.url.path
        if path == "/v1/jobs/job-1":
            return httpx.Response(200, json=job_obj(status="running", extra_field=1))
        if path == "/v1/jobs/job-1/events":
            return httpx.Response(200, json=page([event_obj(3), event_obj(4)]))
        if path == "/v1/jobs/job-1/metrics":
            return httpx.Response(
                200,
                json={
                    "object": "job.metrics",
                    "job_id": "job-1",
                    "columns": {"step": [1, 2], "train_loss": [2.0, 1.5]},
                },
            )
        if path == "/v1/jobs/job-1/logs":
            return httpx.Response(200, text="hello\n", headers={"x-next-offset": "16"})
        return httpx.Response(404)

    client, rec = make_client(handler)
    job = client.jobs.get("job-1")
    assert job.status == "running" and job.model_extra == {"extra_field": 1}
    events = client.jobs.events("job-1", after=2, limit=10)
    assert [e.id for e in events.data] == [3, 4] and isinstance(events.data[0], Event)
    assert rec.requests[1].url.params["after"] == "2"
    assert rec.requests[1].url.params["limit"] == "10"
    assert client.jobs.metrics("job-1").columns["train_loss"] == [2.0, 1.5]
    chunk = client.jobs.logs("job-1", offset=10)
    assert (chunk.text, chunk.next_offset) == ("hello\n", 16)
    assert rec.requests[-1].url.params["offset"] == "10"


def test_follow_logs_streams_text(make_client):
    client, rec = make_client(lambda r: httpx.Response(200, text="a\nb\n"))
    assert "".join(client.jobs.follow_logs("job-1")) == "a\nb\n"
    assert rec.requests[0].url.params["follow"] == "true"


def test_wait_polls_until_terminal(make_client):
    statuses = iter(["queued", "running", "succeeded"])
    client, rec = make_client(lambda r: httpx.Response(200, json=job_obj(status=next(statuses))))
    job = client.jobs.wait("job-1", poll_interval_s=0)
    assert job.status == "succeeded" and job.is_terminal
    assert len(rec.requests) == 3


def test_wait_times_out(make_client):
    client, _ = make_client(lambda r: httpx.Response(200, json=job_obj(status="running")))
    with pytest.raises(TimeoutError, match="still running"):
        client.jobs.wait("job-1", timeout_s=0.05, poll_interval_s=0.01)


def test_files_upload_list_get_delete(make_client, tmp_path):
    file = {
        "id": "file-1",
        "object": "file",
        "filename": "d.jsonl",
        "bytes": 12,
        "sha256": "ab",
        "line_count": 1,
        "format": "text",
        "created_at": 1,
    }

    def handler(request):
        if request.method == "POST":
            return httpx.Response(201, json=file)
        if request.method == "DELETE":
            return httpx.Response(200, json={"id": "file-1", "object": "file", "deleted": True})
        if request.url.path == "/v1/files":
            return httpx.Response(200, json=page([file]))
        return httpx.Response(200, json=file)

    client, rec = make_client(handler)
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "hi"}\n')
    uploaded = client.files.upload(path, format="text")
    assert isinstance(uploaded, File) and uploaded.id == "file-1"
    body = rec.requests[0].content
    assert b'name="file"; filename="d.jsonl"' in body and b'{"text": "hi"}' in body
    assert b'name="format"' in body
    assert client.files.upload(("x.jsonl", b'{"text": "x"}\n')).id == "file-1"
    assert [f.id for f in client.files.list()] == ["file-1"]
    assert client.files.get("file-1").line_count == 1
    assert client.files.delete("file-1").deleted
    assert rec.requests[-1].method == "DELETE"


def test_checkpoints_list_and_download(make_client, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("model.safetensors")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    tar_bytes = buf.getvalue()
    ckpts = [
        {
            "object": "checkpoint",
            "job_id": "job-1",
            "step": s,
            "created_at": 1,
            "path": f"/d/{s}",
            "size_bytes": 3,
            "metrics": {"train_loss": 1.0},
        }
        for s in (20, 10)
    ]

    def handler(request):
        if request.url.path.endswith("/content"):
            return httpx.Response(
                200, content=tar_bytes, headers={"content-type": "application/x-tar"}
            )
        return httpx.Response(200, json=page(ckpts))

    client, rec = make_client(handler)
    assert [c.step for c in client.checkpoints.list("job-1")] == [10, 20]
    path = client.checkpoints.download("job-1", 20, tmp_path)
    assert path == tmp_path / "job-1-step20.tar"
    assert rec.requests[-1].url.path == "/v1/jobs/job-1/checkpoints/20/content"
    with tarfile.open(path) as tar:
        assert tar.getnames() == ["model.safetensors"]
    assert not list(tmp_path.glob("*.part"))


def test_system_demo_health_ready(make_client):
    def handler(request):
        return {
            "/v1/system": httpx.Response(
                200,
                json={
                    "version": "0.1.0",
                    "devices": [{"id": 0}],
                    "adam": {"isa": "avx2", "threads": 2},
                    "jobs": {"queued": 1},
                    "new": True,
                },
            ),
            "/v1/demo": httpx.Response(200, json={"name": "demo", "train": {"steps": 3}}),
            "/healthz": httpx.Response(200, json={"status": "ok"}),
            "/readyz": httpx.Response(200, json={"status": "ready"}),
        }[request.url.path]

    client, _ = make_client(handler)
    system = client.system()
    assert (
        isinstance(system, System) and system.adam["isa"] == "avx2" and system.jobs == {"queued": 1}
    )
    assert client.demo_spec()["name"] == "demo"
    assert client.health() == {"status": "ok"}
    assert client.ready()["status"] == "ready"


def test_ids_are_quoted_in_paths(make_client):
    client, rec = make_client(lambda r: httpx.Response(200, json=job_obj()))
    client.jobs.get("a/b")
    assert rec.requests[0].url.raw_path == b"/v1/jobs/a%2Fb"


def test_async_client_mirrors_the_sync_one(make_async_client):
    jobs = [job_obj(f"job-{i}") for i in range(3)]

    def handler(request):
        path = request.url.path
        if path == "/v1/jobs" and request.method == "POST":
            return httpx.Response(201, json=jobs[0])
        if path == "/v1/jobs":
            after = request.url.params.get("after")
            start = 0 if after is None else int(after.split("-")[1]) + 1
            return httpx.Response(200, json=page(jobs[start : start + 2], has_more=start + 2 < 3))
        if path.endswith("/cancel"):
            return httpx.Response(200, json=job_obj(status="cancelled"))
        if path == "/v1/system":
            return httpx.Response(200, json={"version": "x"})
        return httpx.Response(200, json=job_obj(status="succeeded"))

    async def main():
        client, rec = make_async_client(handler)
        async with client:
            created = await client.jobs.create({"train": {"steps": 1}})
            listed = [job.id async for job in client.jobs.list(page_size=2)]
            cancelled = await client.jobs.cancel("job-0")
            waited = await client.jobs.wait("job-0", poll_interval_s=0)
            system = await client.system()
        return created, listed, cancelled, waited, system, rec

    created, listed, cancelled, waited, system, rec = asyncio.run(main())
    assert created.id == "job-0" and "Idempotency-Key" in rec.requests[0].headers
    assert listed == ["job-0", "job-1", "job-2"]
    assert cancelled.status == "cancelled" and waited.status == "succeeded"
    assert system.version == "x"
    assert str(rec.requests[0].url).startswith(BASE)


def test_async_client_covers_every_call(make_async_client, tmp_path):
    file = {"id": "file-1", "object": "file", "filename": "d.jsonl", "bytes": 3}
    ckpt = {"object": "checkpoint", "job_id": "job-1", "step": 7}

    def handler(request):
        path, method = request.url.path, request.method
        if path == "/v1/files" and method == "POST":
            return httpx.Response(201, json=file)
        if path == "/v1/files":
            return httpx.Response(200, json=page([file]))
        if path == "/v1/files/file-1" and method == "DELETE":
            return httpx.Response(200, json={"id": "file-1", "deleted": True})
        if path == "/v1/files/file-1":
            return httpx.Response(200, json=file)
        if path.endswith("/content"):
            return httpx.Response(200, content=b"tar")
        if path.endswith("/checkpoints"):
            return httpx.Response(200, json=page([ckpt]))
        if path.endswith("/events"):
            return httpx.Response(200, json=page([event_obj(1)]))
        if path.endswith("/metrics"):
            return httpx.Response(200, json={"job_id": "job-1", "columns": {"step": [1]}})
        if path.endswith("/logs"):
            return httpx.Response(200, text="log", headers={"x-next-offset": "3"})
        if path.endswith(("/pause", "/resume")):
            return httpx.Response(200, json=job_obj(status=path.rsplit("/", 1)[1] + "d"))
        if path in ("/healthz", "/readyz", "/v1/demo"):
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json=job_obj())

    async def main():
        client, _ = make_async_client(handler)
        async with client:
            src = tmp_path / "d.jsonl"
            src.write_text("{}\n")
            out = {
                "upload": (await client.files.upload(src, format="text")).id,
                "files": [f.id async for f in client.files.list()],
                "file": (await client.files.get("file-1")).bytes,
                "deleted": (await client.files.delete("file-1")).deleted,
                "checkpoints": [c.step for c in await client.checkpoints.list("job-1")],
                "download": await client.checkpoints.download("job-1", 7, tmp_path / "c.tar"),
                "events": [e.id for e in (await client.jobs.events("job-1", after=0)).data],
                "metrics": (await client.jobs.metrics("job-1")).columns,
                "logs": (await client.jobs.logs("job-1")).next_offset,
                "follow_logs": "".join([t async for t in client.jobs.follow_logs("job-1")]),
                "pause": (await client.jobs.pause("job-1")).status,
                "resume": (await client.jobs.resume("job-1")).status,
                "get": (await client.jobs.get("job-1")).id,
                "health": await client.health(),
                "ready": await client.ready(),
                "demo": await client.demo_spec(),
            }
        return out

    out = asyncio.run(main())
    assert out["upload"] == "file-1" and out["files"] == ["file-1"] and out["file"] == 3
    assert out["deleted"] and out["checkpoints"] == [7]
    assert out["download"].read_bytes() == b"tar"
    assert out["events"] == [1] and out["metrics"] == {"step": [1]} and out["logs"] == 3
    assert out["follow_logs"] == "log"
    assert (out["pause"], out["resume"]) == ("paused", "resumed")
    assert out["get"] == "job-1" and out["health"] == out["ready"] == out["demo"]


def test_export_sync_and_async_without_a_read_timeout(make_client, make_async_client):
    def handler(request):
        assert request.extensions["timeout"]["read"] is None  # a big model takes minutes
        body = json.loads(request.content)
        return httpx.Response(
            200,
            json={
                "object": "export", "job_id": "job-1", "format": "gguf", "type": body["type"],
                "path": "/d/job-1-f16.gguf", "modelfile": "/d/Modelfile", "size_bytes": 9,
            },
        )  # fmt: skip

    client, rec = make_client(handler)
    done = client.jobs.export("job-1")
    assert (done.path, done.modelfile, done.size_bytes, done.type) == (
        "/d/job-1-f16.gguf", "/d/Modelfile", 9, "f16",
    )  # fmt: skip
    assert rec.requests[0].url.path == "/v1/jobs/job-1/export"

    async def main():
        client, _ = make_async_client(handler)
        async with client:
            return await client.jobs.export("job-1", type="q8_0")

    assert asyncio.run(main()).type == "q8_0"
