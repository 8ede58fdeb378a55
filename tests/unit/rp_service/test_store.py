"""The SQLite store: migrations, compare-and-set transitions, event ids, idempotency."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from rp_service.errors import Conflict, TooManyRequests
from rp_service.jobs.store import SCHEMA_VERSION, CheckpointRecord, FileRecord, JobRecord, Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "rp.sqlite3")
    s.open()
    yield s
    s.close()


def _job(job_id: str = "job-1", priority: int = 0) -> JobRecord:
    return JobRecord(id=job_id, status="queued", created_at=1, spec={"x": 1}, priority=priority)


def test_open_records_the_schema_version_and_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    store = Store(path)
    store.open()
    store.open()  # idempotent: nothing left to migrate
    assert store.schema_version() == SCHEMA_VERSION
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    sqlite3.connect(path).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer than this daemon"):
        Store(path).open()


def test_create_job_writes_the_first_status_event(store: Store) -> None:
    job, created, event = store.create_job(_job())
    assert created and job.status == "queued" and job.spec == {"x": 1}
    assert event is not None and event.id == 1
    assert event.data == {"status": "queued", "previous": "validating"}


def test_transition_is_compare_and_set_and_terminal_is_final(store: Store) -> None:
    store.create_job(_job())
    assert store.transition("job-1", ["running"], "succeeded") is None
    job, event = store.transition("job-1", ["queued"], "running", attempt=1, gpus=[0])
    assert job.status == "running" and job.attempt == 1 and job.gpus == [0]
    assert event.id == 2 and event.data == {"status": "running", "previous": "queued"}
    job, _ = store.transition("job-1", ["running"], "cancelled")
    assert job.finished_at is not None
    # Terminal states never change, whatever the caller allows.
    assert store.transition("job-1", ["cancelled", "running"], "queued") is None
    assert store.get_job("job-1").status == "cancelled"
    with pytest.raises(ValueError, match="transition"):
        store.update_job("job-1", status="queued")


def test_event_ids_are_dense_per_job_under_concurrent_writers(store: Store) -> None:
    store.create_job(_job("job-a"))
    store.create_job(_job("job-b"))

    def write(job_id: str) -> None:
        for i in range(25):
            store.append_event(job_id, type_="log", level="info", message=str(i), data={})

    threads = [threading.Thread(target=write, args=(j,)) for j in ("job-a", "job-b") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job_id in ("job-a", "job-b"):
        ids = [e.id for e in store.list_events(job_id, limit=1000)]
        assert ids == list(range(1, 77))
    assert [e.id for e in store.list_events("job-a", after=70, limit=3)] == [71, 72, 73]


def test_append_event_updates_the_job_and_checkpoints_atomically(store: Store) -> None:
    store.create_job(_job())
    ckpt = CheckpointRecord("job-1", 10, 5, "/c/step-10", 123, {"train_loss": 2.0})
    store.append_event(
        "job-1",
        type_="checkpoint",
        level="info",
        message="ckpt",
        data={"step": 10},
        job_fields={"progress": {"step": 10}, "trained_tokens": 640},
        checkpoint=ckpt,
    )
    job = store.get_job("job-1")
    assert job.progress == {"step": 10} and job.trained_tokens == 640
    assert store.list_checkpoints("job-1") == [ckpt]
    assert store.get_checkpoint("job-1", 10) == ckpt
    assert store.get_checkpoint("job-1", 11) is None


def test_idempotency_key_returns_the_same_job_or_conflicts(store: Store) -> None:
    _, created, _ = store.create_job(_job("job-1"), idempotency_key="k", body_sha256="aa")
    again, created_again, event = store.create_job(
        _job("job-2"), idempotency_key="k", body_sha256="aa"
    )
    assert created and not created_again and event is None and again.id == "job-1"
    with pytest.raises(Conflict, match="different request body"):
        store.create_job(_job("job-3"), idempotency_key="k", body_sha256="bb")
    assert [j.id for j in store.list_jobs()[0]] == ["job-1"]


def test_queue_order_is_priority_then_fifo(store: Store) -> None:
    for job_id, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 5)]:
        store.create_job(_job(job_id, priority))
    assert [j.id for j in store.jobs_with_status(["queued"])] == ["b", "d", "a", "c"]
    page, more = store.list_jobs(limit=3)
    assert [j.id for j in page] == ["d", "c", "b"] and more
    page, more = store.list_jobs(after="b", limit=3)
    assert [j.id for j in page] == ["a"] and not more
    assert store.count_by_status() == {"queued": 4}


def test_files_round_trip(store: Store) -> None:
    rec = FileRecord("file-1", "d.jsonl", 10, "ab", 2, "text", 3, "/f/file-1.jsonl")
    store.add_file(rec)
    assert store.get_file("file-1") == rec
    assert store.list_files()[0] == [rec]
    assert store.delete_file("file-1") == rec
    assert store.get_file("file-1") is None and store.delete_file("file-1") is None


def test_a_file_that_an_unfinished_job_uses_cannot_be_deleted(store: Store) -> None:
    store.add_file(FileRecord("file-t", "t.jsonl", 10, "ab", 2, "text", 3, "/f/t.jsonl"))
    store.add_file(FileRecord("file-v", "v.jsonl", 10, "ab", 2, "text", 3, "/f/v.jsonl"))
    uses_train = JobRecord("job-a", "queued", 1, {"data": {"train": "file-t"}})
    uses_valid = JobRecord("job-b", "queued", 1, {"data": {"train": "x", "valid": "file-t"}})
    store.create_job(uses_train)
    store.create_job(uses_valid)
    store.transition("job-b", ["queued"], "paused")
    with pytest.raises(Conflict) as refused:
        store.delete_file("file-t")
    assert refused.value.code == "file_in_use"
    assert refused.value.details == {
        "jobs": [{"id": "job-a", "status": "queued"}, {"id": "job-b", "status": "paused"}]
    }
    assert "job-a (queued), job-b (paused)" in refused.value.message
    assert "cancel" in refused.value.message
    assert store.get_file("file-t") is not None
    assert store.delete_file("file-v") is not None  # no job uses it
    for job_id in ("job-a", "job-b"):
        store.transition(job_id, ["queued", "paused"], "cancelled")
    assert store.delete_file("file-t") is not None  # finished jobs do not hold it


def test_the_queue_cap_holds_under_concurrent_submissions(tmp_path: Path) -> None:
    """30 threads, each with its own connection, against a cap of 5: the count and the
    insert are one transaction, so exactly 5 are queued (20 of 30 passed a separate count)."""
    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    accepted, refused = [], []
    start = threading.Barrier(30)

    def submit(i: int) -> None:
        start.wait()
        try:
            accepted.append(store.create_job(_job(f"job-{i}"), max_queued=5)[1])
        except TooManyRequests as exc:
            refused.append(exc.code)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) == 5 and refused == ["queue_full"] * 25
    assert store.count_by_status() == {"queued": 5}
    store.close()


def test_resume_cannot_push_the_queue_past_its_cap(store: Store) -> None:
    for i in range(3):
        store.create_job(_job(f"job-p{i}"), max_queued=3)
        store.transition(f"job-p{i}", ["queued"], "paused")
    for i in range(3):
        store.create_job(_job(f"job-q{i}"), max_queued=3)
    with pytest.raises(TooManyRequests):
        store.transition("job-p0", ["paused"], "queued", max_queued=3)
    assert store.get_job("job-p0").status == "paused"
    store.transition("job-q0", ["queued"], "running")
    job, _ = store.transition("job-p0", ["paused"], "queued", max_queued=3)
    assert job.status == "queued"
