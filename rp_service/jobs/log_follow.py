"""Following a job's log (`/logs?follow=true`): one reader per followed job, its new bytes
handed from memory to every follower, as jobs/events.py does for events.

A follower used to read the job's status from the store and the file from disk every
0.5 s on the default thread pool: 900 of them made `/healthz` wait up to 1.5 s. Here the
first follower of a job starts a poller that, every `poll_s`, reads the job's status and
then the bytes appended since (one store read and one file read per job, on the store's
reader threads), keeps the newest `tail_bytes` of them, and wakes the followers. A
follower that starts behind that tail catches up from the file, in chunks, on the same
threads; the event loop never touches the store or the file.

    poller (one per job):  status --> new bytes --> tail (newest N bytes) --> wake
    every follower:  [file chunks while behind the tail] -> tail -> wait -> ... -> end
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

from rp_service.jobs.events import EventHub
from rp_service.jobs.store import Store
from rp_service.jobs.store_io import StoreIO
from rp_service.schemas import TERMINAL_STATUSES

__all__ = ["LogHub", "read_from"]

POLL_S = 0.5
TAIL_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20
_READ_MAX_BYTES = 4 << 20  # read by a poller in one go; the rest on its next turn, at once


def read_from(path: Path, offset: int, size: int) -> bytes:
    """Blocking: up to `size` bytes of `path` from `offset`; b"" past its end or without it."""
    try:
        with path.open("rb") as f:
            if offset >= os.fstat(f.fileno()).st_size:
                return b""  # past the end (up to 2**63 - 1): nothing yet, not an error
            f.seek(offset)
            return f.read(size)
    except FileNotFoundError:
        return b""


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _poll(store: Store, job_id: str, path: Path, offset: int | None) -> tuple[bool, int, bytes]:
    """Blocking: whether the job has ended (or is gone), then the bytes from `offset` (None:
    the first poll, which only finds where the file ends). Status first, file second: once
    the job has ended, its worker has written its last line before this read.

    Returns (ended and nothing is left past these bytes, their offset, the bytes).
    """
    job = store.get_job(job_id)
    ended = job is None or job.status in TERMINAL_STATUSES
    if offset is None:
        return False, _file_size(path), b""
    data = read_from(path, offset, _READ_MAX_BYTES)
    return ended and len(data) < _READ_MAX_BYTES, offset, data


class _Channel:
    """One followed job: the newest bytes of its log, and the wake-up of its followers."""

    def __init__(self) -> None:
        self.start: int | None = None  # file offset of tail[0]; None until the first poll
        self.tail = bytearray()
        self.ended = False  # the job has ended and every byte of its log is in or before tail
        self.followers = 0
        self.version = 0
        self._waiters: list[asyncio.Future[None]] = []
        self.poller: asyncio.Task[None] | None = None

    @property
    def end(self) -> int:
        return (self.start or 0) + len(self.tail)

    def append(self, data: bytes, limit: int) -> None:
        self.tail += data
        if len(self.tail) > limit:
            cut = len(self.tail) - limit
            del self.tail[:cut]
            self.start = (self.start or 0) + cut

    async def wait(self, version: int) -> None:
        if self.version != version:
            return  # woken while we looked or sent
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def wake(self) -> None:
        self.version += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class LogHub:
    """Per-job log readers shared by every follower of a job."""

    def __init__(
        self,
        io: StoreIO,
        jobs_dir: Path,
        *,
        events: EventHub | None = None,
        poll_s: float = POLL_S,
        tail_bytes: int = TAIL_BYTES,
    ) -> None:
        self.io = io
        self.jobs_dir = jobs_dir
        self.events = events  # closed by the orchestrator as the daemon stops: so are we
        self.poll_s = poll_s
        self.tail_bytes = tail_bytes
        self._channels: dict[str, _Channel] = {}

    @property
    def closed(self) -> bool:
        """The daemon is stopping: pollers stop, and their followers end, within `poll_s`."""
        return self.events is not None and self.events.closed

    def path(self, job_id: str) -> Path:
        return self.jobs_dir / job_id / "worker.log"

    @contextmanager
    def _subscribe(self, job_id: str) -> Iterator[_Channel]:
        channel = self._channels.get(job_id)
        if channel is None:
            channel = self._channels[job_id] = _Channel()
            channel.poller = asyncio.ensure_future(self._run_poller(job_id, channel))
        channel.followers += 1
        try:
            yield channel
        finally:
            channel.followers -= 1
            if channel.followers == 0 and self._channels.get(job_id) is channel:
                del self._channels[job_id]
                if channel.poller is not None:
                    channel.poller.cancel()

    async def _run_poller(self, job_id: str, channel: _Channel) -> None:
        path = self.path(job_id)
        try:
            while not self.closed:
                offset = None if channel.start is None else channel.end
                ended, at, data = await self.io.read(_poll, self.io.store, job_id, path, offset)
                if channel.start is None:
                    channel.start = at
                channel.append(data, self.tail_bytes)
                channel.ended = ended
                if offset is None or data or ended:
                    channel.wake()
                if ended:
                    return
                if len(data) < _READ_MAX_BYTES and offset is not None:
                    await asyncio.sleep(self.poll_s)
        finally:
            channel.ended = channel.ended or self.closed
            channel.wake()

    async def follow(self, job_id: str, offset: int) -> AsyncIterator[bytes]:
        """The job's log from byte `offset` on, live, until the job has ended."""
        path = self.path(job_id)
        with self._subscribe(job_id) as channel:
            while not self.closed:
                version = channel.version  # taken before looking: a later change wakes us
                poller = channel.poller
                if poller is not None and poller.done() and not channel.ended:
                    poller.result()  # the poller failed: its error ends this stream too
                if channel.start is None:
                    await channel.wait(version)
                    continue
                if offset < channel.start:  # behind the tail: from the file
                    size = min(CHUNK_BYTES, channel.start - offset)
                    data = await self.io.read(read_from, path, offset, size)
                    if not data:  # the file is shorter than it was: nothing to catch up
                        offset = channel.start
                        continue
                    offset += len(data)
                    yield data
                    continue
                if offset < channel.end:
                    data = bytes(channel.tail[offset - channel.start :])
                    offset += len(data)
                    yield data
                    continue
                if channel.ended:
                    return
                await channel.wait(version)
