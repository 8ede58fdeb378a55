"""The SDK against a real daemon on loopback: every call, the error mapping, follow."""

from __future__ import annotations

import asyncio
import tarfile
import threading
import time

import pytest

# client_fixtures puts client/ on sys.path, so the SDK's names come through it.
from .client_fixtures import (  # noqa: F401  (fixtures)
    TOKEN,
    AsyncClient,
    Client,
    Conflict,
    NotFound,
    Unauthorized,
    ValidationError,
    client_fixture,
    daemon_fixture,
    fresh_daemon_fixture,
    real_daemon_fixture,
    tiny_spec,
)


def wait_for(predicate, timeout_s: float = 120.0, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval_s)


def test_system_health_ready_and_demo_spec(client):
    assert client.health() == {"status": "ok"}
    assert client.ready()["status"] == "ready"
    system = client.system()
    assert system.version
    assert isinstance(system.jobs, dict)
    demo = client.demo_spec()
    assert demo["model"]["preset"] and demo["train"]


def test_error_mapping_401_404_409_422(daemon, client):
    with daemon.client(token="wrong-token") as intruder, pytest.raises(Unauthorized) as info:
        intruder.jobs.get("job-x")
    assert info.value.status_code == 401 and info.value.type == "authentication_error"
    with daemon.client(token="") as anonymous, pytest.raises(Unauthorized):
        list(anonymous.jobs.list())
    with Client(daemon.url, token="") as anonymous:
        assert anonymous.health() == {"status": "ok"}  # /healthz needs no token

    with pytest.raises(NotFound) as info:
        client.jobs.get("job-does-not-exist")
    assert info.value.status_code == 404 and info.value.type == "not_found_error"
    assert str(info.value)

    spec = tiny_spec()
    spec["train"]["lr"] = -1.0
    with pytest.raises(ValidationError) as info:
        client.jobs.create(spec)
    assert info.value.status_code == 422
    assert any(e["param"] == "train.lr" for e in info.value.errors), info.value.errors
    assert "train.lr" in str(info.value)

    job = client.jobs.create(tiny_spec(steps=1000))
    cancelled = client.jobs.cancel(job.id)
    assert cancelled.status in ("cancelling", "cancelled")
    wait_for(lambda: client.jobs.get(job.id).status == "cancelled")
    with pytest.raises(Conflict) as info:
        client.jobs.resume(job.id)
    assert info.value.status_code == 409
    assert info.value.response.headers.get("x-should-retry") == "false"


def test_create_is_idempotent_with_a_key(client):
    spec = tiny_spec(steps=1000)
    first = client.jobs.create(spec, idempotency_key="client-it-key-1")
    again = client.jobs.create(spec, idempotency_key="client-it-key-1")
    assert again.id == first.id
    other = dict(spec, name="another")
    with pytest.raises(Conflict):
        client.jobs.create(other, idempotency_key="client-it-key-1")
    client.jobs.cancel(first.id)


def test_list_iterates_every_page(client):
    created = [client.jobs.create(tiny_spec(steps=1000)) for _ in range(3)]
    for job in created:
        client.jobs.cancel(job.id)
    listed = [job.id for job in client.jobs.list(page_size=1)]
    assert {job.id for job in created} <= set(listed)
    assert len(listed) == len(set(listed))
    # Newest first.
    positions = [listed.index(job.id) for job in created]
    assert positions == sorted(positions, reverse=True)
    page = client.jobs.list_page(limit=1)
    assert len(page.data) == 1 and page.has_more
    cancelled = {job.id for job in client.jobs.list(status="cancelled")}
    assert {job.id for job in created} <= cancelled


def test_files_upload_list_get_delete(client, tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(f'{{"text": "line {i} of a tiny dataset"}}\n' for i in range(17)))
    file = client.files.upload(path)
    assert file.id.startswith("file-") and file.filename == "tiny.jsonl"
    assert file.line_count == 17 and file.format == "text" and file.bytes == path.stat().st_size
    assert file.id in {f.id for f in client.files.list()}
    assert client.files.get(file.id).sha256 == file.sha256
    assert client.files.delete(file.id).deleted
    with pytest.raises(NotFound):
        client.files.get(file.id)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValidationError) as info:
        client.files.upload(bad)
    assert info.value.param == "file"


def test_lifecycle_pause_resume_cancel_and_events(client):
    job = client.jobs.create(tiny_spec(steps=100000, checkpoint_interval=0))
    wait_for(lambda: client.jobs.get(job.id).status == "running", timeout_s=180)
    paused = client.jobs.pause(job.id)
    assert paused.status in ("pausing", "paused")
    wait_for(lambda: client.jobs.get(job.id).status == "paused", timeout_s=120)
    resumed = client.jobs.resume(job.id)
    assert resumed.status in ("queued", "running")
    assert client.jobs.cancel(job.id).status in ("cancelling", "cancelled")
    final = client.jobs.wait(job.id, timeout_s=120, poll_interval_s=0.5)
    assert final.status == "cancelled"

    events = list(client.jobs.follow(job.id, reconnect_delay_s=0.2))  # ends: the job is over
    ids = [e.id for e in events]
    assert ids == sorted(set(ids)) and ids[0] == 1
    statuses = [e.data["status"] for e in events if e.type == "status"]
    for status in ("running", "pausing", "paused", "queued", "cancelled"):
        assert status in statuses, statuses
    page = client.jobs.events(job.id, after=ids[1], limit=2)
    assert [e.id for e in page.data] == ids[2:4]


def test_job_runs_to_success_with_checkpoints_metrics_and_logs(real_daemon, tmp_path):
    """The real worker: a tiny qwen3 trained on CPU devices."""
    client = real_daemon.client()
    job = client.jobs.create(tiny_spec(steps=4))
    events = list(client.jobs.follow(job.id, reconnect_delay_s=0.2))
    steps = [e.data["step"] for e in events if e.type == "metrics" and e.data.get("step")]
    assert steps and steps[-1] == 4
    final = client.jobs.get(job.id)
    assert final.status == "succeeded", final.error
    assert final.progress.step == 4 and final.output_model_path
    assert final.trained_tokens > 0

    checkpoints = client.checkpoints.list(job.id)
    assert checkpoints and checkpoints[-1].step == 4
    path = client.checkpoints.download(job.id, checkpoints[-1].step, tmp_path)
    assert path.exists() and tarfile.is_tarfile(path)
    with tarfile.open(path) as tar:
        assert tar.getnames()

    metrics = client.jobs.metrics(job.id)
    assert metrics.columns["step"][-1] == 4 and len(metrics.columns["train_loss"]) == len(
        metrics.columns["step"]
    )
    chunk = client.jobs.logs(job.id)
    assert chunk.next_offset >= len(chunk.text.encode()) and chunk.text
    assert client.jobs.logs(job.id, offset=chunk.next_offset).text == ""
    assert "".join(client.jobs.follow_logs(job.id)) == chunk.text
    client.close()


def test_async_client_end_to_end(daemon):
    async def main():
        async with AsyncClient(daemon.url, token=TOKEN) as aclient:
            job = await aclient.jobs.create(tiny_spec(steps=2))
            events = [e async for e in aclient.jobs.follow(job.id, reconnect_delay_s=0.2)]
            final = await aclient.jobs.wait(job.id, timeout_s=60, poll_interval_s=0.2)
            listed = [j.id async for j in aclient.jobs.list(page_size=2)]
            system = await aclient.system()
            return job, events, final, listed, system

    job, events, final, listed, system = asyncio.run(main())
    assert final.status == "succeeded", final.error
    assert events and events[-1].type == "status"
    assert job.id in listed and system.version


def test_follow_survives_a_daemon_restart(fresh_daemon):
    with fresh_daemon.client() as c:
        job = c.jobs.create(tiny_spec(steps=60, checkpoint_interval=5))
        seen: list = []
        failure: list = []

        def follow() -> None:
            try:
                with fresh_daemon.client(max_retries=10) as follower:
                    for event in follower.jobs.follow(
                        job.id, reconnect_delay_s=0.5, reconnect_timeout_s=240
                    ):
                        seen.append(event)
            except Exception as exc:  # reported by the main thread
                failure.append(exc)

        thread = threading.Thread(target=follow, name="rp-test-follow", daemon=True)
        thread.start()
        wait_for(lambda: any(e.type == "checkpoint" for e in seen), timeout_s=240)
        before = len(seen)
        fresh_daemon.stop()
        fresh_daemon.start()  # same port, same data dir: the job resumes from its checkpoint
        thread.join(timeout=600)
        assert not thread.is_alive(), "follow did not end after the restart"
        assert not failure, failure
        ids = [e.id for e in seen]
        assert len(seen) > before
        assert ids == sorted(set(ids)), "events repeated or out of order across the restart"
        final = c.jobs.get(job.id)
        assert final.status == "succeeded", final.error
        assert final.attempt >= 2
        assert seen[-1].type == "status" and seen[-1].data["status"] == "succeeded"
