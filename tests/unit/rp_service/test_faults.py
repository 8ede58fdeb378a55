"""Fault handling below the daemon: death classification, memory figures, worker error
codes, checkpoints under a full disk, a refused store file, upload names."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rp_service.jobs.faults import MemoryWatch, classify_death, host_memory_limit, tree_rss_bytes
from rp_service.jobs.files import _base_name
from rp_service.jobs.pipe import WorkerHandle
from rp_service.jobs.store import SCHEMA_VERSION, Store, StoreUnusable
from rp_service.worker import checkpoint as ckpt
from rp_service.worker import main as worker

_GIB = 1 << 30


def _memory(rss: int = 0, limit: int = 8 * _GIB, oom_kills: int | None = 0) -> dict[str, Any]:
    return {
        "rss_bytes": rss,
        "peak_rss_bytes": rss,
        "limit_bytes": limit,
        "limit_source": "test",
        "oom_kills": oom_kills,
    }


# ---------------------------------------------------------------- classify_death


def test_the_jobs_own_error_is_not_retried() -> None:
    error = {"code": "invalid_data", "message": "data.train: line 3", "param": "data.train"}
    death = classify_death(1, error, _memory())
    assert not death.retry
    assert death.error == error


def test_a_signal_kill_far_from_the_memory_limit_is_retried() -> None:
    death = classify_death(-signal.SIGKILL, None, _memory(rss=1 * _GIB))
    assert death.retry
    assert death.reason == "worker killed by signal 9 (SIGKILL)"
    assert death.error["code"] == "worker_failed"


def test_a_sigkill_near_the_limit_is_out_of_host_memory_with_figures() -> None:
    death = classify_death(-signal.SIGKILL, None, _memory(rss=int(7.5 * _GIB)))
    assert not death.retry
    assert death.error["code"] == "out_of_host_memory"
    assert death.error["details"]["rss_bytes"] == int(7.5 * _GIB)
    assert death.error["details"]["limit_bytes"] == 8 * _GIB
    assert "7.50 GiB of a 8.00 GiB limit" in death.reason
    assert "train.method: lora" in death.reason and "host-memory plan" in death.reason


def test_the_cgroup_oom_kill_counter_names_the_oom_killer() -> None:
    death = classify_death(-signal.SIGKILL, None, _memory(rss=_GIB, oom_kills=1))
    assert not death.retry
    assert death.error["code"] == "out_of_host_memory"
    assert "OOM killer" in death.reason


def test_a_sigkill_while_the_box_was_full_is_out_of_host_memory() -> None:
    # The worker itself held little, but everything in the cgroup together was at the limit.
    memory = {**_memory(rss=_GIB), "used_bytes": int(7.8 * _GIB)}
    death = classify_death(-signal.SIGKILL, None, memory)
    assert not death.retry and death.error["code"] == "out_of_host_memory"
    assert "1.00 GiB, 7.80 GiB in use by all of a 8.00 GiB limit" in death.reason
    calm = classify_death(-signal.SIGKILL, None, {**_memory(rss=_GIB), "used_bytes": 4 * _GIB})
    assert calm.retry


def test_a_sigterm_near_the_limit_is_not_an_oom_kill() -> None:
    death = classify_death(-signal.SIGTERM, None, _memory(rss=int(7.9 * _GIB)))
    assert death.retry and death.error["code"] == "worker_failed"


def test_device_faults_and_silent_exits_are_retried() -> None:
    fault = {"code": "device_fault", "message": "CUDA error: ECC error", "param": None}
    death = classify_death(1, fault, _memory())
    assert death.retry and death.error["code"] == "device_fault"
    silent = classify_death(0, None, _memory())
    assert silent.retry and silent.reason == "worker exited without reporting success"
    crashed = classify_death(139, None, _memory())
    assert crashed.retry and "status 139" in crashed.reason


# ---------------------------------------------------------------- memory figures


def test_memory_watch_samples_a_child_process_tree() -> None:
    # A child that holds 64 MiB, with a grandchild: the tree's RSS covers the child's.
    code = (
        "import subprocess, sys, time\n"
        "block = bytearray(64 << 20)\n"
        "for i in range(0, len(block), 4096): block[i] = 1\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        watch = MemoryWatch.begin()
        watch.sample(proc.pid)
        assert watch.last_rss_bytes >= 64 << 20
        assert watch.last_rss_bytes > _rss_of(proc.pid)  # the grandchild counted too
        limit, source = host_memory_limit()
        assert limit > watch.last_rss_bytes and source
        assert watch.last_used_bytes is not None and 0 < watch.last_used_bytes < limit
        figures = watch.figures()
        assert figures["rss_bytes"] == figures["peak_rss_bytes"] == watch.last_rss_bytes
    finally:
        _kill_tree(proc)
    gone = MemoryWatch(last_rss_bytes=5)
    gone.sample(proc.pid)  # exited: the last real figure stays
    assert gone.last_rss_bytes == 5


def _rss_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    children = []
    for task in Path(f"/proc/{proc.pid}/task").glob("*"):
        children += [int(c) for c in (task / "children").read_text().split()]
    proc.kill()
    proc.wait()
    for child in children:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_tree_rss_of_a_missing_pid_is_zero() -> None:
    assert tree_rss_bytes(2**22 + 12345) == 0


# ---------------------------------------------------------------- worker error codes


class _Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, type: str, message: str, data: Any = None, level: str = "info") -> None:
        self.seen.append({"type": type, "message": message, "data": data, "level": level})


class _Paths:
    def __init__(self, root: Path) -> None:
        self.checkpoint_dir = root / "checkpoints"


def _fail_for(exc: BaseException, tmp_path: Path) -> dict[str, Any]:
    events = _Events()
    assert worker._fail_for(events, exc, _Paths(tmp_path)) == worker.EXIT_FAILED
    (event,) = events.seen
    assert event["level"] == "error"
    return event["data"]


def test_worker_names_a_full_disk(tmp_path: Path) -> None:
    target = tmp_path / "checkpoints" / ".tmp-step-00000010" / "model.safetensors"
    try:
        raise RuntimeError("save failed") from OSError(
            errno.ENOSPC, "No space left on device", str(target)
        )
    except RuntimeError as exc:
        data = _fail_for(exc, tmp_path)
    assert data["code"] == "disk_full"
    assert str(target) in data["message"] and "earlier checkpoints are intact" in data["message"]
    assert data["details"]["path"] == str(tmp_path)  # the nearest directory that exists
    assert data["details"]["total_bytes"] >= data["details"]["free_bytes"] > 0


def test_worker_names_host_gpu_and_device_faults(tmp_path: Path) -> None:
    host = _fail_for(MemoryError("pinned alloc"), tmp_path)
    assert host["code"] == "out_of_host_memory"
    assert host["details"]["rss_bytes"] > 0 and host["details"]["limit_bytes"] > 0
    assert "train.method: lora" in host["message"]
    gpu = _fail_for(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), tmp_path)
    assert gpu["code"] == "out_of_memory" and gpu["param"] == "engine.num_microbatch"
    assert "train.method: lora" in gpu["message"] and "fewer tokens" in gpu["message"]
    assert gpu["details"] == {}  # no CUDA here: no GPU figures to give
    fault = _fail_for(
        RuntimeError("CUDA error: an illegal memory access was encountered"), tmp_path
    )
    assert fault["code"] == "device_fault"
    own = _fail_for(ValueError("shapes do not match"), tmp_path)
    assert own["code"] == "internal_error"


# ---------------------------------------------------------------- checkpoints, full disk


def _tensors(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"model.safetensors": {"w": torch.full((64, 64), value)}}


def test_a_full_disk_mid_checkpoint_keeps_the_earlier_ones_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    ckpt.write_checkpoint(root, 5, tensors=_tensors(5.0), state={"step": 5}, keep=2)
    ckpt.write_checkpoint(root, 10, tensors=_tensors(10.0), state={"step": 10}, keep=2)
    real_save = ckpt.save_file

    def save_then_fill_the_disk(tensors: Any, path: str) -> None:
        real_save(tensors, path)  # the bytes land, then the next write finds no space
        with open(path, "ab") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(ckpt, "save_file", save_then_fill_the_disk)
    with pytest.raises(OSError) as caught:
        ckpt.write_checkpoint(root, 15, tensors=_tensors(15.0), state={"step": 15}, keep=2)
    assert caught.value.errno == errno.ENOSPC
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005", "step-00000010"]
    latest = ckpt.latest_checkpoint(root)
    assert latest is not None and latest.step == 10
    tensors, state = ckpt.read_checkpoint(latest.path)
    assert state == {"step": 10}
    torch.testing.assert_close(tensors["model.safetensors"]["w"], torch.full((64, 64), 10.0))


# ---------------------------------------------------------------- the store file


def _refused(path: Path) -> str:
    before = path.read_bytes()
    store = Store(path)
    with pytest.raises(StoreUnusable) as caught:
        store.open()
    store.close()
    assert path.read_bytes() == before  # never overwritten
    assert "was not changed" in str(caught.value)
    return str(caught.value)


def test_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    path.write_bytes(b"definitely not a database\n" * 200)
    assert "not a RoundPipe store or is damaged" in _refused(path)


def test_another_programs_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    conn.commit()
    conn.close()
    message = _refused(path)
    assert "another program" in message and "invoices" in message


def test_a_damaged_store_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    store = Store(path)
    store.open()
    with store._write() as conn:
        for i in range(300):
            conn.execute(
                "INSERT INTO events (job_id, id, created_at, level, type, message, data) "
                "VALUES ('job-x', ?, 0, 'info', 'log', ?, '{}')",
                (i + 1, "x" * 500),
            )
    store.close()
    # Checkpoint the WAL into the file, then overwrite a page in the middle with garbage.
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    middle = (len(data) // page // 2) * page
    data[middle : middle + page] = os.urandom(page)
    path.write_bytes(bytes(data))
    _refused(path)


def test_a_good_store_and_a_new_one_open(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    for _ in range(2):  # created, then opened again
        store = Store(path)
        store.open()
        assert store.schema_version() == SCHEMA_VERSION
        store.close()
    empty = tmp_path / "empty.sqlite3"
    empty.touch()  # an empty file is a new database
    store = Store(empty)
    store.open()
    store.close()


def test_the_daemon_refuses_to_start_on_a_foreign_store(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(4000))
    before = path.read_bytes()
    env = {**os.environ, "RP_DATA_DIR": str(tmp_path), "RP_PORT": "0", "RP_GPUS": "none"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rp_service"], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert b"refusing to start" in done.stderr and str(path).encode() in done.stderr
    assert path.read_bytes() == before
    assert time.monotonic() - started < 60


# ---------------------------------------------------------------- uploads, metrics


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("train.jsonl", "train.jsonl"),
        ("../../etc/passwd", "passwd"),
        ("/abs/dir/data.jsonl", "data.jsonl"),
        ("C:\\Users\\me\\data.jsonl", "data.jsonl"),
        ("..", "upload.jsonl"),
        ("dir/", "upload.jsonl"),
        ("", "upload.jsonl"),
        ("a\nb.jsonl", "ab.jsonl"),
        ("x" * 300, "x" * 255),
    ],
)
def test_upload_names_are_plain_base_names(given: str, kept: str) -> None:
    assert _base_name(given) == kept


def test_metrics_events_carry_the_attempt() -> None:
    handle = WorkerHandle(job_id="job-1", gpus=[], attempt=3)
    line = json.dumps({"type": "metrics", "message": "s", "data": {"step": 4, "train_loss": 1.0}})
    event = handle.read_line(line.encode())
    assert event is not None and event["data"]["attempt"] == 3
    assert event["job_fields"]["progress"]["step"] == 4


# ---------------------------------------------------------------- the event journal


def test_recover_stores_what_a_killed_daemon_lost_and_nothing_twice(tmp_path: Path) -> None:
    from rp_service.jobs.journal import recover
    from rp_service.jobs.pipe import journal_path
    from rp_service.jobs.store import JobRecord

    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    store.create_job(JobRecord(id="job-1", status="queued", created_at=0, spec={}))
    store.update_job("job-1", attempt=2)
    handle = WorkerHandle(job_id="job-1", gpus=[], attempt=2)

    def line(type_: str, step: int) -> bytes:
        data: dict[str, Any] = {"step": step, "train_loss": 1.0 / step}
        if type_ == "checkpoint":
            data = {"step": step, "path": f"/ckpt/step-{step}", "size_bytes": 10}
        return json.dumps({"type": type_, "message": "m", "data": data}).encode()

    journal = [line("metrics", s) for s in range(1, 6)] + [line("checkpoint", 5)]
    for raw in journal[:3]:  # the daemon stored steps 1-3, then died
        event = handle.read_line(raw)
        assert event is not None
        store.append_event("job-1", **event)
    job_dir = tmp_path / "jobs" / "job-1"
    job_dir.mkdir(parents=True)
    journal_path(job_dir, 2).write_bytes(b"\n".join(journal) + b'\n{"type": "metr')
    running = store.get_job("job-1")
    assert running is not None and running.progress["step"] == 3
    assert recover(store, running, job_dir) == 3
    assert recover(store, store.get_job("job-1"), job_dir) == 0  # type: ignore[arg-type]
    metrics = store.list_events("job-1", type_="metrics")
    assert [(e.data["step"], e.data["attempt"]) for e in metrics] == [(s, 2) for s in range(1, 6)]
    assert [c.step for c in store.list_checkpoints("job-1")] == [5]
    assert store.get_job("job-1").progress["step"] == 5  # type: ignore[union-attr]
    store.close()


def test_recover_stores_lost_sample_events_once_with_their_attempt(tmp_path: Path) -> None:
    from rp_service.jobs.journal import recover
    from rp_service.jobs.pipe import journal_path
    from rp_service.jobs.store import JobRecord

    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    store.create_job(JobRecord(id="job-1", status="queued", created_at=0, spec={}))
    store.update_job("job-1", attempt=3)
    handle = WorkerHandle(job_id="job-1", gpus=[], attempt=3)

    def sample(step: int) -> bytes:
        samples = [{"prompt": "hi", "completion": f"at {step}", "tokens": 2}]
        data = {"step": step, "samples": samples, "tokens": 2}
        return json.dumps({"type": "sample", "message": "m", "data": data}).encode()

    stored = handle.read_line(sample(2))  # the daemon stored step 2's, then died
    assert stored is not None
    store.append_event("job-1", **stored)
    job_dir = tmp_path / "jobs" / "job-1"
    job_dir.mkdir(parents=True)
    journal_path(job_dir, 3).write_bytes(sample(2) + b"\n" + sample(4) + b"\n")
    job = store.get_job("job-1")
    assert job is not None
    assert recover(store, job, job_dir) == 1
    assert recover(store, job, job_dir) == 0
    events = store.list_events("job-1", type_="sample")
    assert [(e.data["step"], e.data["attempt"]) for e in events] == [(2, 3), (4, 3)]
    assert events[1].data["samples"][0]["completion"] == "at 4"
    store.close()


# ---------------------------------------------------------------- a store that cannot write


def test_a_workers_exit_is_recorded_once_the_store_can_be_written_again(tmp_path: Path) -> None:
    import asyncio

    from rp_service.jobs.events import EventHub
    from rp_service.jobs.orchestrator import Orchestrator
    from rp_service.jobs.store import JobRecord
    from rp_service.settings import Settings

    class FullDiskStore(Store):
        failures = 0

        def transition(self, *args: Any, **kwargs: Any) -> Any:
            if self.failures > 0:
                self.failures -= 1
                raise sqlite3.OperationalError("database or disk is full")
            return super().transition(*args, **kwargs)

    store = FullDiskStore(tmp_path / "rp.sqlite3")
    store.open()
    orchestrator = Orchestrator(Settings(data_dir=tmp_path, gpus="none"), store, EventHub())
    for job_id, failures, expected in (("job-a", 2, "succeeded"), ("job-b", 9, "running")):
        store.create_job(JobRecord(id=job_id, status="queued", created_at=0, spec={}))
        store.transition(job_id, ["queued"], "running")
        handle = WorkerHandle(job_id=job_id, gpus=[], succeeded=True)
        store.failures = failures
        asyncio.run(orchestrator._settle_durably(handle, 0, delays_s=(0.01, 0.01)))
        job = store.get_job(job_id)
        assert job is not None and job.status == expected  # given up: left for reconcile
    store.close()


def test_cgroup_memory_in_use_leaves_out_reclaimable_file_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rp_service.jobs import faults

    monkeypatch.setattr(faults, "_CGROUP_ROOT", tmp_path)
    (tmp_path / "memory.max").write_text("8000\n")
    (tmp_path / "memory.current").write_text("5000\n")
    (tmp_path / "memory.stat").write_text("anon 3000\ninactive_file 1200\nactive_file 800\n")
    assert faults.host_memory_used(str(tmp_path / "memory.max")) == 3800
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.usage_in_bytes").write_text("9000\n")
    (v1 / "memory.stat").write_text("cache 100\ntotal_inactive_file 2000\n")
    assert faults.host_memory_used(str(v1 / "memory.limit_in_bytes")) == 7000


def test_a_cancel_during_the_settling_of_a_death_still_ends_the_job(tmp_path: Path) -> None:
    import asyncio

    from rp_service.jobs.events import EventHub
    from rp_service.jobs.orchestrator import Orchestrator
    from rp_service.jobs.store import JobRecord
    from rp_service.settings import Settings

    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    orchestrator = Orchestrator(Settings(data_dir=tmp_path, gpus="none"), store, EventHub())
    store.create_job(JobRecord(id="job-c", status="queued", created_at=0, spec={}))
    store.transition("job-c", ["queued"], "running")
    handle = WorkerHandle(job_id="job-c", gpus=[])

    async def scenario() -> None:
        real_get = orchestrator.get

        async def get_then_cancel(job_id: str) -> Any:
            job = await real_get(job_id)
            store.transition(job_id, ["running"], "cancelling")  # the user's cancel lands here
            return job

        orchestrator.get = get_then_cancel  # type: ignore[method-assign]
        await orchestrator._settle(handle, -signal.SIGKILL)

    asyncio.run(scenario())
    job = store.get_job("job-c")
    assert job is not None and job.status == "cancelled"
    store.close()


def test_the_daemon_refuses_a_port_in_use_before_it_says_ready(tmp_path: Path) -> None:
    """It used to log "ready" (the lifespan runs first) and then exit 3 on the bind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "RP_DATA_DIR": str(tmp_path), "RP_PORT": str(port), "RP_GPUS": "none"}
        done = subprocess.run(
            [sys.executable, "-m", "rp_service"], env=env, capture_output=True, timeout=60
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}".encode() in done.stderr
    assert b" ready:" not in done.stderr  # the lifespan did not run
