"""Fan-out of stored events: each event is handed from memory to every follower of its job.

The orchestrator stores an event, then `publish`es the stored record. The hub keeps, per
followed job, a ring of the newest events already encoded as SSE bytes, so an event costs
one store write and one encoding however many follow it. The first follower of a job
fills the ring with one store read (the newest events and the job's status); followers
that join meanwhile wait for that same read. A follower whose last id is older than the
ring reaches back catches up from the store, in pages, on the store's reader threads; the
event loop never reads the store. Subscribing before reading, and skipping ids already
sent, is what makes a reconnect with `Last-Event-ID` lose and duplicate nothing.

    orchestrator: store.append_event --(writer thread)--> hub.publish(job, event, status)
                                                             |
    first follower: subscribe -> fill (newest N + status) -> ring: newest N, encoded
    every follower: subscribe -> [store pages while behind the ring] -> ring -> wait
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from itertools import islice

from sse_starlette import ServerSentEvent

from rp_service.jobs.store import EventRecord, JobRecord, Store
from rp_service.jobs.store_io import StoreIO
from rp_service.schemas import TERMINAL_STATUSES

__all__ = ["SSE_RETRY_MS", "EventHub", "event_json", "sse_stream"]

log = logging.getLogger(__name__)

SSE_RETRY_MS = 3000
RING_EVENTS = 1024
# Followers of a busy job are woken at most once per this many seconds, and then send all
# that is new as one chunk: a send costs the loop about the same for one event as for
# fifty. An event after a quiet spell still goes out at once.
WAKE_EVERY_S = 0.05
# Followers are woken this many per turn of the event loop: a request that arrives while
# hundreds of followers send waits for one batch of them, not for all.
_WAKE_BATCH = 32
# New followers admitted per turn of the loop: a reconnect storm of hundreds is set up a
# batch at a time, and requests that arrive meanwhile are answered between the batches.
_ADMIT_BATCH = 16
_PAGE = 500
_RETRY = ServerSentEvent(retry=SSE_RETRY_MS).encode()

_Entry = tuple[int, bytes]  # an event id and its SSE bytes


def event_json(event: EventRecord) -> str:
    """The public Event object as JSON (the same object as a list item)."""
    return json.dumps({"object": "event", **asdict(event)})


def _sse(event: EventRecord) -> bytes:
    return ServerSentEvent(data=event_json(event), id=str(event.id), event=event.type).encode()


def _done(job_id: str, status: str) -> bytes:
    data = json.dumps({"job_id": job_id, "status": status})
    return ServerSentEvent(data=data, event="done").encode()


def _final_status(job: JobRecord | None) -> str | None:
    """The status a `done` event reports once the job's events are sent; None: not ended."""
    if job is None:
        return "deleted"
    return job.status if job.status in TERMINAL_STATUSES else None


class _Channel:
    """One followed job: the ring of its newest events and the wake-up of its followers.

    Once filled, the ring is one run of consecutive ids that ends with the newest event
    stored: everything committed after the fill's read is published into it.
    """

    def __init__(self, ring_events: int, wake_every_s: float) -> None:
        self.ring: deque[_Entry] = deque(maxlen=ring_events)
        self.final: tuple[int, str] | None = None  # after this id, `done` with this status
        self.fill: asyncio.Future[None] | None = None
        self.generation = 0  # bumped by `EventHub.notify`: a fill read before is stale
        self.followers = 0
        self.version = 0  # bumped by every wake-up
        self._waiters: list[asyncio.Future[None]] = []
        self.wake_every_s = wake_every_s
        self._woken_at = float("-inf")
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ wake-ups

    async def wait(self, version: int) -> None:
        """Return after the first wake-up past `version` (the one seen before looking)."""
        if self.version != version:
            return  # woken while we looked or sent
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter  # our own future: a cancelled follower cancels no one else

    def wake(self) -> None:
        """Wake every follower now, a batch per turn of the loop."""
        self.stop_timer()
        loop = asyncio.get_running_loop()
        self._woken_at = loop.time()
        self.version += 1
        waiters, self._waiters = self._waiters, []
        _release(loop, waiters, 0)

    def wake_soon(self) -> None:
        """Wake every follower now, or `wake_every_s` after the last wake-up."""
        if self._timer is not None:
            return  # a wake-up is due already; it will see this event too
        loop = asyncio.get_running_loop()
        due = self._woken_at + self.wake_every_s
        if loop.time() >= due:
            self.wake()
        else:
            self._timer = loop.call_at(due, self.wake)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------ the ring

    def append(self, entry: _Entry) -> None:
        if self.ring and entry[0] <= self.ring[-1][0]:
            return  # already in the ring, or older than it: the store has it
        if self.ring and entry[0] != self.ring[-1][0] + 1:
            self.ring.clear()  # a gap: the ring stays one run of consecutive ids
        self.ring.append(entry)

    def merge_fill(self, entries: list[_Entry]) -> None:
        """Put the fill's read (consecutive, ascending) before what was published since."""
        published = list(self.ring)
        if published and entries and entries[-1][0] + 1 < published[0][0]:
            return  # more was published during the read than the ring holds: keep that
        self.ring.clear()
        for entry in entries:
            if published and entry[0] >= published[0][0]:
                break
            self.ring.append(entry)
        self.ring.extend(published)

    def after(self, last: int) -> list[_Entry] | None:
        """Ring entries with id > `last`; None when the ring does not reach back to last + 1."""
        if not self.ring or self.ring[-1][0] <= last:
            return []
        first = self.ring[0][0]
        if first > last + 1:
            return None
        return list(islice(self.ring, last + 1 - first, None))


def _release(
    loop: asyncio.AbstractEventLoop, waiters: list[asyncio.Future[None]], start: int
) -> None:
    for waiter in waiters[start : start + _WAKE_BATCH]:
        if not waiter.done():
            waiter.set_result(None)
    if start + _WAKE_BATCH < len(waiters):
        loop.call_soon(_release, loop, waiters, start + _WAKE_BATCH)


class EventHub:
    """Per-job broadcast of stored events to everything that follows a job."""

    def __init__(
        self, *, ring_events: int = RING_EVENTS, wake_every_s: float = WAKE_EVERY_S
    ) -> None:
        self.ring_events = ring_events
        self.wake_every_s = wake_every_s
        self._channels: dict[str, _Channel] = {}
        self.closed = False
        self._admitted = 0  # followers admitted in this turn of the loop
        self._admitting: deque[asyncio.Future[None]] = deque()
        self._turn: asyncio.Handle | None = None

    async def admit(self) -> None:
        """Return when a new follower may be set up: `_ADMIT_BATCH` per turn of the loop."""
        loop = asyncio.get_running_loop()
        if self._turn is None:
            self._turn = loop.call_soon(self._next_turn, loop)
        if self._admitted < _ADMIT_BATCH and not self._admitting:
            self._admitted += 1
            return
        waiter = loop.create_future()
        self._admitting.append(waiter)
        await waiter

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._admitted = 0
        while self._admitting and self._admitted < _ADMIT_BATCH:
            waiter = self._admitting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._admitted += 1
        self._turn = loop.call_soon(self._next_turn, loop) if self._admitting else None

    @contextmanager
    def subscribe(self, job_id: str) -> Iterator[_Channel]:
        channel = self._channels.get(job_id)
        if channel is None:
            channel = self._channels[job_id] = _Channel(self.ring_events, self.wake_every_s)
        channel.followers += 1
        try:
            yield channel
        finally:
            channel.followers -= 1
            if channel.followers == 0 and self._channels.get(job_id) is channel:
                channel.stop_timer()
                del self._channels[job_id]

    def publish(self, job_id: str, event: EventRecord, *, status: str | None = None) -> None:
        """Hand a stored event to the followers of its job; call it after the commit.

        `status` is the job's status as of this event when the event changed it (a
        transition); a terminal one tells the followers to say `done` after this event.
        """
        channel = self._channels.get(job_id)
        if channel is None:
            return  # nobody follows: nothing to encode
        channel.append((event.id, _sse(event)))
        if status in TERMINAL_STATUSES:
            channel.final = (event.id, status)
        channel.wake_soon()

    def notify(self, job_id: str) -> None:
        """The job changed outside `publish` (say, its events were removed): its followers
        read the store again, from the last id each one sent."""
        channel = self._channels.get(job_id)
        if channel is not None:
            channel.ring.clear()
            channel.final = None
            channel.fill = None
            channel.generation += 1
            channel.wake()

    def close(self) -> None:
        """Wake every follower for the last time: the daemon is stopping."""
        self.closed = True
        for channel in self._channels.values():
            channel.wake()


def _newest(store: Store, job_id: str, limit: int) -> tuple[str | None, list[_Entry]]:
    """Blocking: the job's final status (None while it runs), then its newest events.

    Status first, events second: a terminal status is committed together with its status
    event, so when we see the status its event is in what we read next.
    """
    final = _final_status(store.get_job(job_id))
    return final, [(e.id, _sse(e)) for e in store.last_events(job_id, limit=limit)]


def _page(store: Store, job_id: str, after: int) -> tuple[str | None, int, bytes, int]:
    """Blocking: the job's final status, then one page of its events after `after`.

    Returns the final status (None while it runs), the last id in the page (`after` when
    empty), the page as SSE bytes and the number of events in it.
    """
    final = _final_status(store.get_job(job_id))
    events = store.list_events(job_id, after=after, limit=_PAGE)
    last = events[-1].id if events else after
    return final, last, b"".join(_sse(e) for e in events), len(events)


async def _fill(io: StoreIO, job_id: str, channel: _Channel) -> None:
    """The one store read that fills a new channel's ring; wakes the followers when done.

    A task of its own, not a follower's: one follower leaving does not cancel the read
    the others wait for.
    """
    generation = channel.generation
    try:
        final, entries = await io.read(_newest, io.store, job_id, channel.ring.maxlen)
        if channel.generation != generation:
            return  # `notify` came during the read: the followers wait for the next fill
        channel.merge_fill(entries)
        if final is not None and channel.final is None:
            channel.final = (entries[-1][0] if entries else 0, final)
    finally:
        channel.wake()


async def sse_stream(
    io: StoreIO, hub: EventHub, job_id: str, *, after: int
) -> AsyncIterator[bytes]:
    """Server-sent events of one job from id `after` on, live, then `done` when it ends.

    Yields encoded SSE bytes; the events a follower is behind on go out as one chunk.
    """
    with hub.subscribe(job_id) as channel:
        # `retry` goes first: with the first events when they are at hand (the fill and a
        # page read are short waits), alone before the first wait for new ones. One send
        # fewer per connection counts when hundreds reconnect at once.
        head = _RETRY
        last = after
        while not hub.closed:
            version = channel.version  # taken before looking: a later change wakes us
            if channel.fill is None:
                channel.fill = asyncio.ensure_future(_fill(io, job_id, channel))
            fill = channel.fill
            if not fill.done():
                await channel.wait(version)
                continue
            if fill.exception() is not None:
                if channel.fill is fill:
                    channel.fill = None  # the next follower tries again
                raise fill.exception()  # type: ignore[misc]
            fresh = channel.after(last)
            if fresh is None:  # behind the ring: catch up from the store, a page at a time
                final, last, chunk, count = await io.read(_page, io.store, job_id, last)
                if count < _PAGE and final is not None:
                    yield head + chunk + _done(job_id, final)
                    return
                if chunk or head:
                    yield head + chunk
                    head = b""
                elif count == 0:
                    await channel.wait(version)
                continue
            chunk = b"".join(entry for _, entry in fresh)
            if fresh:
                last = fresh[-1][0]
            if channel.final is not None and last >= channel.final[0]:
                yield head + chunk + _done(job_id, channel.final[1])
                return
            if chunk or head:
                yield head + chunk
                head = b""
                continue
            await channel.wait(version)
        if head:
            yield head
