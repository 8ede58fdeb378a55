"""Deleting a job's files: renamed to a trash name, then removed; the trash swept at start."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from rp_service.errors import DiskFull
from rp_service.jobs.events import EventHub
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.pipe import WorkerHandle
from rp_service.jobs.retention import TRASH_PREFIX, delete_job
from rp_service.jobs.store import CheckpointRecord, JobRecord, Store
from rp_service.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, gpus="none")


@pytest.fixture
def store(settings: Settings) -> Store:
    s = Store(settings.data_dir / "rp.sqlite3")
    s.open()
    yield s
    s.close()


def _finished_job(store: Store, settings: Settings, job_id: str) -> Path:
    store.create_job(JobRecord(id=job_id, status="queued", created_at=1, spec={}))
    store.transition(job_id, ["queued"], "cancelled")
    folder = settings.jobs_dir / job_id
    (folder / "checkpoints" / "step-2").mkdir(parents=True)
    (folder / "checkpoints" / "step-2" / "state.json").write_text("{}")
    (folder / "worker.log").write_text("log")
    return folder


def test_a_delete_leaves_neither_the_folder_nor_its_trash(store: Store, settings: Settings) -> None:
    folder = _finished_job(store, settings, "job-a")
    assert delete_job(settings, store, "job-a") is not None
    assert not folder.exists()
    assert list(settings.jobs_dir.iterdir()) == []


def test_what_a_killed_delete_left_is_swept_at_start(store: Store, settings: Settings) -> None:
    """kill -9 mid-delete leaves a trash folder half removed, or (between the row and the
    rename) the deleted job's folder itself; the start-up path removes both, nothing else."""
    _finished_job(store, settings, "job-gone")
    store.mark_deleted("job-gone")  # killed before its folder was renamed
    trash = settings.jobs_dir / f"{TRASH_PREFIX}job-older"  # killed mid-removal
    (trash / "checkpoints").mkdir(parents=True)
    (trash / "checkpoints" / "x.safetensors").write_bytes(b"0" * 10)
    kept = _finished_job(store, settings, "job-kept")
    Orchestrator(settings, store, EventHub()).reconcile()
    assert sorted(p.name for p in settings.jobs_dir.iterdir()) == ["job-kept"]
    assert (kept / "worker.log").read_text() == "log"


def test_a_file_that_cannot_be_removed_is_logged_and_swept_later(
    store: Store, settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    _finished_job(store, settings, "job-a")
    real_unlink = os.unlink

    def refuse(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith("worker.log"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    with caplog.at_level(logging.ERROR, logger="rp_service.jobs.retention"):
        assert delete_job(settings, store, "job-a") is not None
    assert "worker.log" in caplog.text and "some of its files remain" in caplog.text
    assert [p.name for p in settings.jobs_dir.iterdir()] == [f"{TRASH_PREFIX}job-a"]
    monkeypatch.setattr(os, "unlink", real_unlink)
    Orchestrator(settings, store, EventHub()).reconcile()
    assert list(settings.jobs_dir.iterdir()) == []


def test_a_full_disk_pauses_the_job_keeps_its_checkpoints_and_resumes_when_freed(
    tmp_path: Path,
) -> None:
    """The worker's disk_full: paused (waiting_for_disk, in the job's error), no checkpoint
    pruned (a failed job kept one), a resume refused while the disk is full, then queued
    again by the disk watch once the floor is free."""
    settings = Settings(
        data_dir=tmp_path, gpus="none", min_free_bytes=1 << 62, keep_finished_checkpoints=1
    )
    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    orchestrator = Orchestrator(settings, store, EventHub())
    store.create_job(JobRecord(id="job-d", status="queued", created_at=0, spec={}))
    store.transition("job-d", ["queued"], "running")
    for step in (5, 10, 15):
        path = tmp_path / "jobs" / "job-d" / "checkpoints" / f"step-{step}"
        path.mkdir(parents=True)
        record = CheckpointRecord("job-d", step, 0, str(path), 1, {})
        store.append_event(
            "job-d", type_="checkpoint", level="info", message="", data={}, checkpoint=record
        )
    handle = WorkerHandle(job_id="job-d", gpus=[])
    handle.last_error = {
        "code": "disk_full",
        "message": "disk full while writing step-20",
        "param": None,
        "details": {"free_bytes": 10},
    }

    async def scenario() -> None:
        await orchestrator._settle(handle, 1)
        job = store.get_job("job-d")
        assert job.status == "paused" and job.error["code"] == "waiting_for_disk", job
        assert "disk full while writing step-20" in job.error["message"]
        assert [c.step for c in store.list_checkpoints("job-d")] == [5, 10, 15]
        assert await orchestrator._resume_waiting_for_disk() == 0
        with pytest.raises(DiskFull):
            await orchestrator.resume("job-d")
        assert store.get_job("job-d").status == "paused"
        settings.min_free_bytes = 0  # space is back, but not for a checkpoint this big
        huge = CheckpointRecord("job-d", 16, 0, str(tmp_path / "x"), 1 << 62, {})
        store.append_event(
            "job-d", type_="checkpoint", level="info", message="", data={}, checkpoint=huge
        )
        assert await orchestrator._resume_waiting_for_disk() == 0
        store.delete_checkpoints("job-d", [16])
        assert await orchestrator._resume_waiting_for_disk() == 1
        job = store.get_job("job-d")
        assert job.status == "queued" and job.error is None

    asyncio.run(scenario())
    store.close()
