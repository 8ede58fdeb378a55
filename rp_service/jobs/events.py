"""Fan-out of stored events: subscribers are woken, then read what is new from the store.

A subscriber never receives events from memory, only a wake-up; it then reads ids greater
than the last one it sent. Subscribing before the replay and reading from the store after
every wake-up is what makes a reconnect with `Last-Event-ID` lose and duplicate nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict

from sse_starlette import ServerSentEvent

from rp_service.jobs.store import EventRecord, Store
from rp_service.schemas import TERMINAL_STATUSES

__all__ = ["SSE_RETRY_MS", "EventHub", "event_json", "sse_stream"]

log = logging.getLogger(__name__)

SSE_RETRY_MS = 3000
_PAGE = 500


def event_json(event: EventRecord) -> str:
    """The public Event object as JSON (the same object as a list item)."""
    return json.dumps({"object": "event", **asdict(event)})


class EventHub:
    """Per-job wake-ups for everything that follows a job's events."""

    def __init__(self) -> None:
        self._subscribers: dict[str, set[asyncio.Event]] = {}
        self.closed = False

    @contextmanager
    def subscribe(self, job_id: str) -> Iterator[asyncio.Event]:
        wake = asyncio.Event()
        self._subscribers.setdefault(job_id, set()).add(wake)
        try:
            yield wake
        finally:
            subs = self._subscribers.get(job_id)
            if subs is not None:
                subs.discard(wake)
                if not subs:
                    del self._subscribers[job_id]

    def notify(self, job_id: str) -> None:
        """Wake the subscribers of `job_id`; call it after the event is in the store."""
        for wake in self._subscribers.get(job_id, ()):
            wake.set()

    def close(self) -> None:
        """Wake every subscriber for the last time: the daemon is stopping."""
        self.closed = True
        for subs in self._subscribers.values():
            for wake in subs:
                wake.set()


async def sse_stream(
    store: Store, hub: EventHub, job_id: str, *, after: int
) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events of one job from id `after` on, live, then `done` when it ends."""
    with hub.subscribe(job_id) as wake:
        yield ServerSentEvent(retry=SSE_RETRY_MS)
        last = after
        while not hub.closed:
            wake.clear()
            # Status first, events second: a terminal status is committed together with its
            # status event, so when we see the status its event is in the page below.
            job = await asyncio.to_thread(store.get_job, job_id)
            events = await asyncio.to_thread(store.list_events, job_id, after=last, limit=_PAGE)
            for event in events:
                yield ServerSentEvent(data=event_json(event), id=str(event.id), event=event.type)
                last = event.id
            if len(events) == _PAGE:
                continue
            if job is None or job.status in TERMINAL_STATUSES:
                status = job.status if job is not None else "deleted"
                yield ServerSentEvent(
                    data=json.dumps({"job_id": job_id, "status": status}), event="done"
                )
                return
            await wake.wait()
