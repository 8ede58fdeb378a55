"""The event hub: followers are served from memory, catch up from the store when behind."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rp_service.jobs.events import EventHub, sse_stream
from rp_service.jobs.store import EventRecord, JobRecord, Store
from rp_service.jobs.store_io import StoreIO

JOB = "job-1"


class CountingStore(Store):
    """A store that counts its event and job reads (from any thread)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.reads[name] += 1

    def get_job(self, job_id: str) -> JobRecord | None:
        self._count("get_job")
        return super().get_job(job_id)

    def list_events(self, *args: Any, **kwargs: Any) -> list[EventRecord]:
        self._count("list_events")
        return super().list_events(*args, **kwargs)

    def last_events(self, *args: Any, **kwargs: Any) -> list[EventRecord]:
        self._count("last_events")
        return super().last_events(*args, **kwargs)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = CountingStore(tmp_path / "rp.sqlite3")
    s.open()
    s.create_job(JobRecord(id=JOB, status="queued", created_at=1, spec={}))  # event 1
    s.transition(JOB, ["queued"], "running")  # event 2
    yield s
    s.close()


def _append(store: Store, hub: EventHub, n: int) -> list[int]:
    """Store `n` metrics events and publish each, as the orchestrator does."""
    ids = []
    for step in range(n):
        event = store.append_event(
            JOB, type_="metrics", level="info", message=f"step {step}", data={"step": step}
        )
        hub.publish(JOB, event)
        ids.append(event.id)
    return ids


def _finish(store: Store, hub: EventHub) -> int:
    job, event = store.transition(JOB, ["running"], "succeeded")
    hub.publish(JOB, event, status=job.status)
    return event.id


def _blocks(chunk: bytes) -> list[dict[str, str]]:
    out = []
    for raw in chunk.decode().replace("\r\n", "\n").split("\n\n"):
        if raw:
            out.append(dict(line.split(": ", 1) for line in raw.split("\n")))
    return out


async def _collect(stream: AsyncIterator[bytes]) -> tuple[list[int], dict[str, Any] | None]:
    """Event ids and the `done` payload of a whole stream; checks `retry` comes first."""
    ids: list[int] = []
    done = None
    first = True
    async for chunk in stream:
        for block in _blocks(chunk):
            if first:
                assert block == {"retry": "3000"}
                first = False
                continue
            if block["event"] == "done":
                done = json.loads(block["data"])
            else:
                assert json.loads(block["data"])["id"] == int(block["id"])
                ids.append(int(block["id"]))
    return ids, done


def test_many_followers_cost_one_store_read_not_one_per_follower_per_event(store) -> None:
    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub(ring_events=64, wake_every_s=0)
        followers = [
            asyncio.create_task(_collect(sse_stream(io, hub, JOB, after=0))) for _ in range(50)
        ]
        await asyncio.sleep(0.2)  # all subscribed and past the fill
        store.reads.clear()
        for _ in range(30):
            _append(store, hub, 1)
            await asyncio.sleep(0)
        last = _finish(store, hub)
        results = await asyncio.wait_for(asyncio.gather(*followers), timeout=10)
        assert store.reads == Counter()  # every live event came from memory
        for ids, done in results:
            assert ids == list(range(1, last + 1))
            assert done == {"job_id": JOB, "status": "succeeded"}
        io.close()

    asyncio.run(scenario())


def test_followers_that_join_together_share_one_fill(store) -> None:
    _append(store, EventHub(), 10)

    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub(ring_events=64, wake_every_s=0)
        followers = [
            asyncio.create_task(_collect(sse_stream(io, hub, JOB, after=3))) for _ in range(20)
        ]
        await asyncio.sleep(0.2)
        last = _finish(store, hub)
        results = await asyncio.wait_for(asyncio.gather(*followers), timeout=10)
        assert store.reads["last_events"] == 1
        assert store.reads["list_events"] == 0
        assert all(ids == list(range(4, last + 1)) for ids, _ in results)
        io.close()

    asyncio.run(scenario())


def test_a_follower_behind_the_ring_catches_up_from_the_store_in_pages(
    store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rp_service.jobs import events

    monkeypatch.setattr(events, "_PAGE", 7)
    _append(store, EventHub(), 40)  # ids 3..42, more than the ring holds

    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub(ring_events=5, wake_every_s=0)
        stream = sse_stream(io, hub, JOB, after=0)
        follower = asyncio.create_task(_collect(stream))
        await asyncio.sleep(0.2)
        # A follower that stops reading while 30 more events pass, then goes on.
        slow = sse_stream(io, hub, JOB, after=0)
        seen = [await slow.__anext__(), await slow.__anext__()]  # retry, the first page
        _append(store, hub, 30)
        last = _finish(store, hub)
        async for chunk in slow:
            seen.append(chunk)
        ids, done = await asyncio.wait_for(follower, timeout=10)
        assert ids == list(range(1, last + 1))
        assert done == {"job_id": JOB, "status": "succeeded"}
        slow_ids = [int(b["id"]) for c in seen for b in _blocks(c) if "id" in b]
        assert slow_ids == list(range(1, last + 1))
        assert _blocks(seen[-1])[-1]["event"] == "done"
        assert store.reads["list_events"] >= 42 // 7  # paged, never one read for all
        io.close()

    asyncio.run(scenario())


def test_resume_after_an_id_and_the_replay_of_a_finished_job(store) -> None:
    _append(store, EventHub(), 5)
    last = _finish(store, EventHub())

    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub(ring_events=3, wake_every_s=0)
        assert await _collect(sse_stream(io, hub, JOB, after=0)) == (
            list(range(1, last + 1)),
            {"job_id": JOB, "status": "succeeded"},
        )
        tail, done = await _collect(sse_stream(io, hub, JOB, after=last - 1))
        assert tail == [last] and done["status"] == "succeeded"
        beyond, done = await _collect(sse_stream(io, hub, JOB, after=last + 5))
        assert beyond == [] and done["status"] == "succeeded"
        io.close()

    asyncio.run(scenario())


def test_wake_ups_of_a_busy_job_are_coalesced_into_one_chunk(store) -> None:
    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub(wake_every_s=0.2)
        stream = sse_stream(io, hub, JOB, after=2)
        await stream.__anext__()  # retry
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.3)  # the fill's wake-up is long past: a quiet spell
        first = _append(store, hub, 1)  # sent at once
        assert [int(b["id"]) for b in _blocks(await asyncio.wait_for(nxt, 0.1))] == first
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)  # the follower waits for the next wake-up
        burst = _append(store, hub, 1)  # within wake_every_s of the last wake-up: held
        await asyncio.sleep(0.05)
        assert not nxt.done()
        burst += _append(store, hub, 4)
        chunk = await asyncio.wait_for(nxt, 1)  # one wake-up, one chunk for all five
        assert [int(b["id"]) for b in _blocks(chunk)] == burst
        await stream.aclose()
        io.close()

    asyncio.run(scenario())


def test_notify_makes_followers_read_the_store_again(store) -> None:
    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub(wake_every_s=0)
        follower = asyncio.create_task(_collect(sse_stream(io, hub, JOB, after=0)))
        await asyncio.sleep(0.2)
        # Written without a publish (as a tool outside the orchestrator might): only the
        # notify tells the followers to look.
        for step in range(3):
            store.append_event(JOB, type_="metrics", level="info", message="m", data={"s": step})
        store.transition(JOB, ["running"], "failed")
        hub.notify(JOB)
        ids, done = await asyncio.wait_for(follower, timeout=10)
        assert ids == list(range(1, 7))
        assert done == {"job_id": JOB, "status": "failed"}
        io.close()

    asyncio.run(scenario())


def test_close_ends_every_stream(store) -> None:
    async def scenario() -> None:
        io = StoreIO(store)
        hub = EventHub()
        follower = asyncio.create_task(_collect(sse_stream(io, hub, JOB, after=0)))
        await asyncio.sleep(0.2)
        hub.close()
        ids, done = await asyncio.wait_for(follower, timeout=5)
        assert ids == [1, 2] and done is None
        io.close()

    asyncio.run(scenario())


def test_a_reconnect_storm_is_admitted_a_batch_per_turn_of_the_loop() -> None:
    from rp_service.jobs import events

    async def scenario() -> None:
        hub = EventHub()
        admitted: list[int] = []

        async def follower(i: int) -> None:
            await hub.admit()
            admitted.append(i)

        tasks = [asyncio.create_task(follower(i)) for i in range(40)]
        await asyncio.sleep(0)  # one turn: every follower has asked once
        first_turn = len(admitted)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        assert first_turn == events._ADMIT_BATCH
        assert admitted == list(range(40))  # in the order they came

    asyncio.run(scenario())
