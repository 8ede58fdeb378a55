"""A job's events: a JSON page, or server-sent events with `Accept: text/event-stream`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from rp_service.api.deps import OutputsDep, SettingsDep
from rp_service.errors import InvalidRequest
from rp_service.schemas import MAX_INT64, ErrorEnvelope, Event, ListPage

router = APIRouter(prefix="/v1/jobs", tags=["events"])


@router.get(
    "/{job_id}/events",
    response_model=ListPage[Event],
    responses={
        200: {"content": {"text/event-stream": {}}},
        404: {"model": ErrorEnvelope, "description": "no such job"},
    },
)
async def job_events(
    request: Request,
    job_id: Annotated[str, Path(min_length=1, max_length=200)],
    outputs: OutputsDep,
    settings: SettingsDep,
    after: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    last_event_id: Annotated[str | None, Header(max_length=40)] = None,
) -> ListPage[Event] | EventSourceResponse:
    """Events with id > `after` (or > `Last-Event-ID`), ascending."""
    if "text/event-stream" in request.headers.get("accept", ""):
        start = after
        if last_event_id:
            value = last_event_id.strip()
            if not (value.isascii() and value.isdigit()) or int(value) > MAX_INT64:
                raise InvalidRequest(
                    f"Last-Event-ID must be an event id (an integer); got {last_event_id!r}",
                    param="Last-Event-ID",
                )
            start = max(start, int(value))
        stream = await outputs.event_stream(job_id, after=start)
        return EventSourceResponse(
            stream,
            ping=settings.sse_ping_s,
            ping_message_factory=lambda: ServerSentEvent(comment="ping"),
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    records, has_more = await outputs.events_page(job_id, after=after, limit=limit)
    data = [Event.model_validate(r, from_attributes=True) for r in records]
    return ListPage[Event](
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )
