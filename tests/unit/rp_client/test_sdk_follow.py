"""`jobs.follow`: events until `done`, reconnecting with Last-Event-ID."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from rp_client import APIConnectionError, NotFound

from ._fakes import error_response, event_obj, sse_body

SSE = {"content-type": "text/event-stream"}


def test_follow_yields_events_until_done(make_client):
    body = sse_body([event_obj(1), event_obj(2, type="status", status="running")], done="succeeded")
    client, rec = make_client(lambda r: httpx.Response(200, content=body, headers=SSE))
    events = list(client.jobs.follow("job-1", reconnect_delay_s=0))
    assert [(e.id, e.type) for e in events] == [(1, "metrics"), (2, "status")]
    request = rec.requests[0]
    assert request.headers["Accept"] == "text/event-stream"
    assert "Last-Event-ID" not in request.headers
    assert len(rec.requests) == 1


def test_follow_starts_after_the_given_id(make_client):
    client, rec = make_client(
        lambda r: httpx.Response(200, content=sse_body([event_obj(8)], done="failed"), headers=SSE)
    )
    assert [e.id for e in client.jobs.follow("job-1", after=7)] == [8]
    assert rec.requests[0].headers["Last-Event-ID"] == "7"


def test_follow_reconnects_with_last_event_id_after_a_drop(make_client):
    def broken_stream():
        yield sse_body([event_obj(1), event_obj(2)])
        raise httpx.ReadError("connection reset")

    answers = iter(
        [
            httpx.Response(200, content=broken_stream(), headers=SSE),
            httpx.Response(200, content=sse_body([event_obj(3)]), headers=SSE),  # ends without done
            error_response(503, "server_error", "restarting"),
            httpx.ConnectError("refused"),
            httpx.Response(200, content=sse_body([event_obj(4)], done="succeeded"), headers=SSE),
        ]
    )

    def handler(request):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client, rec = make_client(handler)
    events = list(client.jobs.follow("job-1", reconnect_delay_s=0))
    assert [e.id for e in events] == [1, 2, 3, 4]
    sent = [r.headers.get("Last-Event-ID") for r in rec.requests]
    assert sent == [None, "2", "3", "3", "3"]


def test_follow_uses_the_stream_retry_delay(make_client, monkeypatch):
    slept = []
    monkeypatch.setattr("rp_client._jobs.time.sleep", slept.append)
    answers = iter(
        [
            httpx.Response(200, content=sse_body([event_obj(1)], retry_ms=250), headers=SSE),
            httpx.Response(200, content=sse_body([], done="succeeded"), headers=SSE),
        ]
    )
    client, _ = make_client(lambda r: next(answers))
    assert [e.id for e in client.jobs.follow("job-1")] == [1]
    assert slept == [0.25]


def test_follow_gives_up_after_reconnect_timeout(make_client):
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    client, _ = make_client(handler)
    with pytest.raises(APIConnectionError, match="lost the event stream"):
        list(client.jobs.follow("job-1", reconnect_delay_s=0.01, reconnect_timeout_s=0.05))


def test_follow_raises_not_found_at_once(make_client):
    client, rec = make_client(lambda r: error_response(404, "not_found_error", "no job job-x"))
    with pytest.raises(NotFound, match="no job job-x"):
        list(client.jobs.follow("job-x", reconnect_delay_s=0))
    assert len(rec.requests) == 1


def test_async_follow_reconnects_with_last_event_id(make_async_client):
    async def broken_stream():
        yield sse_body([event_obj(1)])
        raise httpx.ReadError("connection reset")

    answers = iter(
        [
            httpx.Response(200, content=broken_stream(), headers=SSE),
            httpx.Response(200, content=sse_body([event_obj(2)], done="cancelled"), headers=SSE),
        ]
    )
    client, rec = make_async_client(lambda r: next(answers))

    async def main():
        async with client:
            return [e.id async for e in client.jobs.follow("job-1", reconnect_delay_s=0)]

    assert asyncio.run(main()) == [1, 2]
    assert [r.headers.get("Last-Event-ID") for r in rec.requests] == [None, "1"]
