"""`client.jobs`: submit, list, follow, wait and steer jobs (sync and async twins)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import httpx
from httpx_sse import EventSource

from . import errors
from ._base import DEFAULT_RECONNECT_DELAY_S, SpecLike, _params, _q
from .models import Event, Export, Job, JobDeleted, JobMetrics, LogChunk, Page

if TYPE_CHECKING:
    from ._client import AsyncClient, Client

__all__ = ["AsyncJobs", "Jobs"]

log = logging.getLogger(__name__)


def _event_stream_timeout(timeout_s: float) -> httpx.Timeout:
    # The daemon sends `: ping` every 15 s: a minute of silence means a dead connection
    # (a dropped network path never closes the socket), so read again from a new one.
    return httpx.Timeout(timeout_s, read=60.0)


# An export loads and writes a whole model: minutes for a large one, so no read timeout.
_EXPORT_TIMEOUT = httpx.Timeout(30.0, read=None)


def _export_body(format: str, type: str) -> dict[str, str]:
    return {"format": format, "type": type}


def _sse_event(data: str) -> Event | None:
    try:
        return Event.model_validate_json(data)
    except ValueError:
        # Not an event object (a comment-like payload from a proxy): skip it.
        return None


class Jobs:
    """`client.jobs`: submit, list, watch and steer training jobs."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, spec: SpecLike, *, idempotency_key: str | None = None) -> Job:
        """Submits a job from a dict, a `JobSpec`, or a YAML/JSON file path.

        An `Idempotency-Key` is always sent (a fresh one unless given), so a retry after a
        dropped connection returns the same job instead of submitting a second one.
        """
        body = self._client._spec_body(spec)
        key = idempotency_key or self._client._new_idempotency_key()
        response = self._client._send(
            "POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}
        )
        return self._client._parse(Job, response)

    def list_page(
        self, *, status: str | None = None, after: str | None = None, limit: int | None = None
    ) -> Page[Job]:
        """One page of jobs, newest first."""
        response = self._client._send(
            "GET", "/v1/jobs", params=_params(status=status, after=after, limit=limit)
        )
        return self._client._parse(Page[Job], response)

    def list(self, *, status: str | None = None, page_size: int | None = None) -> Iterator[Job]:
        """Every job (newest first), fetching pages as the iteration needs them."""
        after: str | None = None
        while True:
            page = self.list_page(status=status, after=after, limit=page_size)
            yield from page.data
            after = self._client._next_cursor(page, after)
            if after is None:
                return

    def get(self, job_id: str) -> Job:
        return self._client._parse(Job, self._client._send("GET", f"/v1/jobs/{_q(job_id)}"))

    def cancel(self, job_id: str) -> Job:
        """Asks the job to stop; it goes `cancelling` then `cancelled`."""
        return self._action(job_id, "cancel")

    def pause(self, job_id: str) -> Job:
        """Checkpoints the job and releases its GPUs (`pausing` then `paused`)."""
        return self._action(job_id, "pause")

    def resume(self, job_id: str) -> Job:
        """Puts a paused job back in the queue; it continues from its checkpoint."""
        return self._action(job_id, "resume")

    def _action(self, job_id: str, action: str) -> Job:
        response = self._client._send("POST", f"/v1/jobs/{_q(job_id)}/{action}")
        return self._client._parse(Job, response)

    def export(self, job_id: str, *, format: str = "gguf", type: str = "f16") -> Export:
        """Writes a succeeded job's model as GGUF (`type` f32, f16 or q8_0) with an Ollama
        Modelfile, on the daemon's disk; `ValidationError` (422) for a model llama.cpp
        cannot load, `Conflict` before the job succeeded."""
        response = self._client._send(
            "POST",
            f"/v1/jobs/{_q(job_id)}/export",
            json=_export_body(format, type),
            timeout=_EXPORT_TIMEOUT,
        )
        return self._client._parse(Export, response)

    def delete(self, job_id: str) -> JobDeleted:
        """Deletes a finished job with its checkpoints, outputs and log (`Conflict` if it
        has not finished: cancel it first)."""
        response = self._client._send("DELETE", f"/v1/jobs/{_q(job_id)}")
        return self._client._parse(JobDeleted, response)

    def events(
        self, job_id: str, *, after: int | None = None, limit: int | None = None
    ) -> Page[Event]:
        """A page of the job's events, ascending ids greater than `after`."""
        response = self._client._send(
            "GET", f"/v1/jobs/{_q(job_id)}/events", params=_params(after=after, limit=limit)
        )
        return self._client._parse(Page[Event], response)

    def follow(
        self,
        job_id: str,
        *,
        after: int | None = None,
        reconnect_delay_s: float | None = None,
        reconnect_timeout_s: float = 300.0,
    ) -> Iterator[Event]:
        """Yields the job's events as they happen; returns once the job has ended.

        A dropped stream (or a daemon restart) is reopened with `Last-Event-ID`, so no
        event is missed or repeated.

        Args:
            after: start after this event id (default: from the first event).
            reconnect_delay_s: wait between reconnects; default the stream's `retry:`.
            reconnect_timeout_s: give up (`APIConnectionError`) after this long unreachable.
        """
        path = f"/v1/jobs/{_q(job_id)}/events"
        last_id = after
        delay_s = DEFAULT_RECONNECT_DELAY_S if reconnect_delay_s is None else reconnect_delay_s
        down_since: float | None = None
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
            if last_id is not None:
                headers["Last-Event-ID"] = str(last_id)
            try:
                with self._client._stream(
                    "GET",
                    path,
                    headers=headers,
                    retries=0,
                    timeout=_event_stream_timeout(self._client.timeout_s),
                ) as response:
                    down_since = None
                    for sse in EventSource(response).iter_sse():
                        if sse.retry is not None and reconnect_delay_s is None:
                            delay_s = sse.retry / 1000
                        if sse.event == "done":
                            return
                        event = _sse_event(sse.data) if sse.data else None
                        if event is not None:
                            last_id = event.id
                            yield event
            except httpx.TransportError:
                pass  # the stream broke mid-way: reconnect below
            except errors.APIConnectionError:
                pass
            except errors.ServerError as exc:
                if exc.status_code != 503:
                    raise
            log.info("event stream of %s interrupted; reconnecting after id %s", job_id, last_id)
            now = time.monotonic()
            down_since = down_since if down_since is not None else now
            if now - down_since > reconnect_timeout_s:
                raise errors.APIConnectionError(
                    f"lost the event stream of {job_id} for more than {reconnect_timeout_s:g} s"
                )
            time.sleep(delay_s)

    def wait(
        self, job_id: str, *, timeout_s: float | None = None, poll_interval_s: float = 2.0
    ) -> Job:
        """Polls until the job has ended and returns it; `TimeoutError` after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if job.is_terminal:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout_s:g} s")
            time.sleep(poll_interval_s)

    def metrics(self, job_id: str) -> JobMetrics:
        """Per-step columns (step, train_loss, ...) for plots."""
        response = self._client._send("GET", f"/v1/jobs/{_q(job_id)}/metrics")
        return self._client._parse(JobMetrics, response)

    def logs(self, job_id: str, *, offset: int = 0) -> LogChunk:
        """The worker's log from byte `offset`; pass `next_offset` to read on."""
        response = self._client._send(
            "GET", f"/v1/jobs/{_q(job_id)}/logs", params={"offset": offset}
        )
        return LogChunk.model_validate(self._client._log_chunk(response, offset))

    def follow_logs(self, job_id: str, *, offset: int = 0) -> Iterator[str]:
        """Yields the worker's log text as it is written, until the job ends."""
        with self._client._stream(
            "GET",
            f"/v1/jobs/{_q(job_id)}/logs",
            params={"offset": offset, "follow": "true"},
            timeout=httpx.Timeout(self._client.timeout_s, read=None),
        ) as response:
            yield from response.iter_text()


class AsyncJobs:
    """`client.jobs` of `AsyncClient`; see `Jobs`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, spec: SpecLike, *, idempotency_key: str | None = None) -> Job:
        """Submits a job; see `Jobs.create`."""
        body = self._client._spec_body(spec)
        key = idempotency_key or self._client._new_idempotency_key()
        response = await self._client._send(
            "POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}
        )
        return self._client._parse(Job, response)

    async def list_page(
        self, *, status: str | None = None, after: str | None = None, limit: int | None = None
    ) -> Page[Job]:
        """One page of jobs, newest first."""
        response = await self._client._send(
            "GET", "/v1/jobs", params=_params(status=status, after=after, limit=limit)
        )
        return self._client._parse(Page[Job], response)

    async def list(
        self, *, status: str | None = None, page_size: int | None = None
    ) -> AsyncIterator[Job]:
        """Every job (newest first): `async for job in client.jobs.list()`."""
        after: str | None = None
        while True:
            page = await self.list_page(status=status, after=after, limit=page_size)
            for job in page.data:
                yield job
            after = self._client._next_cursor(page, after)
            if after is None:
                return

    async def get(self, job_id: str) -> Job:
        return self._client._parse(Job, await self._client._send("GET", f"/v1/jobs/{_q(job_id)}"))

    async def cancel(self, job_id: str) -> Job:
        return await self._action(job_id, "cancel")

    async def pause(self, job_id: str) -> Job:
        return await self._action(job_id, "pause")

    async def resume(self, job_id: str) -> Job:
        return await self._action(job_id, "resume")

    async def _action(self, job_id: str, action: str) -> Job:
        response = await self._client._send("POST", f"/v1/jobs/{_q(job_id)}/{action}")
        return self._client._parse(Job, response)

    async def export(self, job_id: str, *, format: str = "gguf", type: str = "f16") -> Export:
        response = await self._client._send(
            "POST",
            f"/v1/jobs/{_q(job_id)}/export",
            json=_export_body(format, type),
            timeout=_EXPORT_TIMEOUT,
        )
        return self._client._parse(Export, response)

    async def delete(self, job_id: str) -> JobDeleted:
        """Deletes a finished job with its checkpoints, outputs and log (`Conflict` if it
        has not finished: cancel it first)."""
        response = await self._client._send("DELETE", f"/v1/jobs/{_q(job_id)}")
        return self._client._parse(JobDeleted, response)

    async def events(
        self, job_id: str, *, after: int | None = None, limit: int | None = None
    ) -> Page[Event]:
        response = await self._client._send(
            "GET", f"/v1/jobs/{_q(job_id)}/events", params=_params(after=after, limit=limit)
        )
        return self._client._parse(Page[Event], response)

    async def follow(
        self,
        job_id: str,
        *,
        after: int | None = None,
        reconnect_delay_s: float | None = None,
        reconnect_timeout_s: float = 300.0,
    ) -> AsyncIterator[Event]:
        """Yields the job's events until it ends, reconnecting; see `Jobs.follow`."""
        path = f"/v1/jobs/{_q(job_id)}/events"
        last_id = after
        delay_s = DEFAULT_RECONNECT_DELAY_S if reconnect_delay_s is None else reconnect_delay_s
        down_since: float | None = None
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
            if last_id is not None:
                headers["Last-Event-ID"] = str(last_id)
            try:
                async with self._client._stream(
                    "GET",
                    path,
                    headers=headers,
                    retries=0,
                    timeout=_event_stream_timeout(self._client.timeout_s),
                ) as response:
                    down_since = None
                    async for sse in EventSource(response).aiter_sse():
                        if sse.retry is not None and reconnect_delay_s is None:
                            delay_s = sse.retry / 1000
                        if sse.event == "done":
                            return
                        event = _sse_event(sse.data) if sse.data else None
                        if event is not None:
                            last_id = event.id
                            yield event
            except httpx.TransportError:
                pass  # the stream broke mid-way: reconnect below
            except errors.APIConnectionError:
                pass
            except errors.ServerError as exc:
                if exc.status_code != 503:
                    raise
            log.info("event stream of %s interrupted; reconnecting after id %s", job_id, last_id)
            now = time.monotonic()
            down_since = down_since if down_since is not None else now
            if now - down_since > reconnect_timeout_s:
                raise errors.APIConnectionError(
                    f"lost the event stream of {job_id} for more than {reconnect_timeout_s:g} s"
                )
            await asyncio.sleep(delay_s)

    async def wait(
        self, job_id: str, *, timeout_s: float | None = None, poll_interval_s: float = 2.0
    ) -> Job:
        """Polls until the job has ended and returns it; `TimeoutError` after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = await self.get(job_id)
            if job.is_terminal:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout_s:g} s")
            await asyncio.sleep(poll_interval_s)

    async def metrics(self, job_id: str) -> JobMetrics:
        response = await self._client._send("GET", f"/v1/jobs/{_q(job_id)}/metrics")
        return self._client._parse(JobMetrics, response)

    async def logs(self, job_id: str, *, offset: int = 0) -> LogChunk:
        response = await self._client._send(
            "GET", f"/v1/jobs/{_q(job_id)}/logs", params={"offset": offset}
        )
        return LogChunk.model_validate(self._client._log_chunk(response, offset))

    async def follow_logs(self, job_id: str, *, offset: int = 0) -> AsyncIterator[str]:
        async with self._client._stream(
            "GET",
            f"/v1/jobs/{_q(job_id)}/logs",
            params={"offset": offset, "follow": "true"},
            timeout=httpx.Timeout(self._client.timeout_s, read=None),
        ) as response:
            async for text in response.aiter_text():
                yield text
