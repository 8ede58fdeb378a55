"""Log following from memory (rp_service/jobs/log_follow.py, via JobOutputs.follow_log):
one store read per poll per job, however many follow it, and every follower gets every
byte, once, in order."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

from rp_service.jobs.events import EventHub
from rp_service.jobs.outputs import JobOutputs
from rp_service.jobs.store_io import StoreIO
from rp_service.settings import Settings

FOLLOWERS = 100


@dataclass
class _Job:
    status: str


class _CountingStore:
    """The one store call log following makes, counted (from any thread)."""

    def __init__(self) -> None:
        self.status = "running"
        self.reads = 0
        self._lock = threading.Lock()

    def get_job(self, job_id: str) -> _Job | None:
        with self._lock:
            self.reads += 1
        return _Job(self.status) if job_id == "job-1" else None


async def _collect(outputs: JobOutputs, offset: int) -> bytes:
    body = b""
    async for chunk in await outputs.follow_log("job-1", offset=offset):
        body += chunk
    return body


def test_a_hundred_followers_share_one_reader(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    store = _CountingStore()
    outputs = JobOutputs(settings, store, EventHub(), io=StoreIO(store))  # type: ignore[arg-type]
    log = settings.jobs_dir / "job-1" / "worker.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"line 0\n")
    lines = [f"line {i}\n".encode() for i in range(1, 21)]

    async def run() -> list[bytes]:
        followers = [asyncio.create_task(_collect(outputs, 0)) for _ in range(FOLLOWERS)]
        late = None
        for i, line in enumerate(lines):
            await asyncio.sleep(0.02)
            with log.open("ab") as f:
                f.write(line)
            if i == 10:  # one that joins in the middle, from byte 3
                late = asyncio.create_task(_collect(outputs, 3))
        await asyncio.sleep(0.1)
        store.status = "succeeded"
        assert late is not None
        return await asyncio.wait_for(asyncio.gather(*followers, late), timeout=10)

    bodies = asyncio.run(run())
    whole = log.read_bytes()
    assert bodies[:-1] == [whole] * FOLLOWERS
    assert bodies[-1] == whole[3:]
    # One existence check per follower (its 404), then one read per poll of the job (every
    # 0.5 s: ~3 here), not one per poll per follower (~300).
    polls = store.reads - (FOLLOWERS + 1)
    assert polls <= 10, store.reads


def test_a_finished_jobs_log_is_sent_whole_and_ends(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    store = _CountingStore()
    store.status = "failed"
    outputs = JobOutputs(settings, store, EventHub(), io=StoreIO(store))  # type: ignore[arg-type]
    outputs.logs.tail_bytes = 1000  # the log is larger: most of it comes from the file
    log = settings.jobs_dir / "job-1" / "worker.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"".join(f"{i:09d}\n".encode() for i in range(300_000)))  # 3 MB

    async def run() -> tuple[bytes, bytes]:
        return await asyncio.gather(_collect(outputs, 0), _collect(outputs, 2_999_990))

    whole, tail = asyncio.run(asyncio.wait_for(run(), timeout=20))
    assert whole == log.read_bytes()
    assert tail == log.read_bytes()[2_999_990:]
