"""What a job leaves behind, read back: event pages, metric series, logs, checkpoints, and
its model exported (jobs/export.py)."""

from __future__ import annotations

import asyncio
import os
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from rp_service.data.preference import PREFERENCE_METRICS
from rp_service.data.prompts import GRPO_METRICS
from rp_service.errors import NotFound
from rp_service.jobs.events import EventHub, sse_stream
from rp_service.jobs.export import export_job
from rp_service.jobs.log_follow import LogHub, read_from
from rp_service.jobs.store import CheckpointRecord, EventRecord, JobRecord, Store
from rp_service.jobs.store_io import StoreIO
from rp_service.schemas import Export, ExportRequest
from rp_service.settings import Settings

__all__ = ["GRPO_COLUMNS", "PREFERENCE_COLUMNS", "SERIES_COLUMNS", "JobOutputs"]

SERIES_COLUMNS = (
    "step",
    "attempt",
    "train_loss",
    "valid_loss",
    "learning_rate",
    "tokens_per_second",
)
# A DPO job's metrics (TRL's names): columns of its series, absent from other jobs'.
PREFERENCE_COLUMNS = PREFERENCE_METRICS
GRPO_COLUMNS = GRPO_METRICS  # a GRPO job's series (its `rewards` dict stays in the events)
_LOG_CHUNK_BYTES = 1 << 20
_TAR_CHUNK_BYTES = 1 << 20


class JobOutputs:
    """Read-side services of a job; each checks that the job exists first (404)."""

    def __init__(
        self, settings: Settings, store: Store, hub: EventHub, *, io: StoreIO | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        self.io = io if io is not None else StoreIO(store)
        self.logs = LogHub(self.io, settings.jobs_dir, events=hub)

    async def _job(self, job_id: str) -> JobRecord:
        job = await asyncio.to_thread(self.store.get_job, job_id)
        if job is None:
            raise NotFound(f"no job with id {job_id!r}", code="job_not_found", param="job_id")
        return job

    async def export(self, job_id: str, request: ExportRequest) -> Export:
        """The job's model exported as `request` asks (docs/EXPORT.md); runs a child process."""
        return await export_job(self.settings, await self._job(job_id), request)

    async def events_page(
        self, job_id: str, *, after: int, limit: int
    ) -> tuple[list[EventRecord], bool]:
        await self._job(job_id)
        events = await self.io.read(self.store.list_events, job_id, after=after, limit=limit + 1)
        return events[:limit], len(events) > limit

    async def event_stream(self, job_id: str, *, after: int) -> AsyncIterator[bytes]:
        """Checks the job (so a 404 comes before the stream starts), then the SSE stream."""
        await self.hub.admit()
        await self._job(job_id)
        return sse_stream(self.io, self.hub, job_id, after=after)

    async def metric_series(self, job_id: str) -> dict[str, list[float | int | None]]:
        """One row per step, in step order: a step trained again after a resume keeps the
        latest attempt's values (events are read in id order, so later rows overwrite)."""
        await self._job(job_id)
        rows: dict[int, dict[str, float | int | None]] = {}
        names = SERIES_COLUMNS
        after = 0
        while True:
            page = await self.io.read(
                self.store.list_events, job_id, after=after, limit=5000, type_="metrics"
            )
            for event in page:
                if names is SERIES_COLUMNS and PREFERENCE_COLUMNS[0] in event.data:
                    names = SERIES_COLUMNS + PREFERENCE_COLUMNS
                elif names is SERIES_COLUMNS and GRPO_COLUMNS[0] in event.data:
                    names = SERIES_COLUMNS + GRPO_COLUMNS
                row = {}
                for name in names:
                    value = event.data.get(name)
                    row[name] = value if isinstance(value, int | float) else None
                step = event.data.get("step")
                rows[step if isinstance(step, int) else -event.id] = row
            if len(page) < 5000:
                break
            after = page[-1].id
        ordered = [rows[k] for k in sorted(rows)]
        return {name: [row.get(name) for row in ordered] for name in names}

    async def read_log(self, job_id: str, *, offset: int) -> tuple[bytes, int]:
        """Up to 1 MiB of the worker's log from `offset`, and the offset after it."""
        await self._job(job_id)
        path = self.logs.path(job_id)
        data = await asyncio.to_thread(read_from, path, offset, _LOG_CHUNK_BYTES)
        return data, offset + len(data)

    async def follow_log(self, job_id: str, *, offset: int) -> AsyncIterator[bytes]:
        """Checks the job, then streams its log from `offset` until the job has ended
        (jobs/log_follow.py: one reader per job, however many follow it)."""
        await self.hub.admit()
        await self._job(job_id)
        return self.logs.follow(job_id, offset)

    async def checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        """Committed checkpoints still on disk (the worker prunes beyond keep_checkpoints)."""
        await self._job(job_id)
        records = await asyncio.to_thread(self.store.list_checkpoints, job_id)
        return [r for r in records if await asyncio.to_thread(Path(r.path).exists)]

    async def checkpoint_tar(self, job_id: str, step: int) -> Iterator[bytes]:
        """A tar stream of one committed checkpoint directory."""
        await self._job(job_id)
        record = await asyncio.to_thread(self.store.get_checkpoint, job_id, step)
        if record is None:
            raise NotFound(
                f"job {job_id} has no checkpoint at step {step}; list them with "
                f"GET /v1/jobs/{job_id}/checkpoints",
                code="checkpoint_not_found",
                param="step",
            )
        root = Path(record.path)
        if not root.exists():
            raise NotFound(
                f"checkpoint at step {step} of job {job_id} was removed (keep_checkpoints)",
                code="checkpoint_not_found",
                param="step",
            )
        return _tar_stream(root)


def _tar_stream(root: Path) -> Iterator[bytes]:
    """Yield a ustar/pax archive of `root` file by file, never holding a whole file."""
    paths = [root] if root.is_file() else [root, *sorted(root.rglob("*"))]
    for path in paths:
        arcname = os.path.join(root.name, path.relative_to(root).as_posix()).rstrip("/.")
        if path == root:
            arcname = root.name
        info = tarfile.TarInfo(arcname)
        st = path.stat()
        info.mtime = int(st.st_mtime)
        info.mode = st.st_mode & 0o777
        if path.is_dir():
            info.type = tarfile.DIRTYPE
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            continue
        if not path.is_file():
            continue
        info.size = st.st_size
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        with path.open("rb") as f:
            while sent < info.size:
                chunk = f.read(min(_TAR_CHUNK_BYTES, info.size - sent))
                if not chunk:
                    break
                sent += len(chunk)
                yield chunk
        if sent < info.size:  # the file shrank while we read it: keep the archive aligned
            yield b"\0" * (info.size - sent)
        remainder = info.size % tarfile.BLOCKSIZE
        if remainder:
            yield b"\0" * (tarfile.BLOCKSIZE - remainder)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
