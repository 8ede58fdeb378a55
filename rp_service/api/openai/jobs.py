"""OpenAI's fine-tuning routes: `/v1/fine_tuning/jobs` and what hangs off a job."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response

from rp_service.api.deps import FineTuningDep
from rp_service.api.openai._route import OpenAIRoute
from rp_service.errors import BadRequest
from rp_service.openai.schemas import (
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCreate,
    FineTuningJobEvent,
    OpenAIList,
)
from rp_service.schemas import ErrorEnvelope

__all__ = ["router"]

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["openai"], route_class=OpenAIRoute)

JobId = Annotated[str, Path(min_length=1, max_length=200, description="A job id, job-...")]
After = Annotated[str | None, Query(max_length=200, description="the last id of the page before")]
# The OpenAI SDK numbers its attempts at one call: > 0 marks a retry.
RetryCount = Annotated[int | None, Header(ge=0, le=1000)]
_METADATA_KEY = re.compile(r"metadata\[(.+)\]")  # the SDK's form of metadata={k: v}
_ERRORS = {
    400: {"model": ErrorEnvelope, "description": "an invalid or unsupported parameter"},
    404: {"model": ErrorEnvelope, "description": "no such job"},
    409: {"model": ErrorEnvelope, "description": "illegal transition"},
}


def _only_query(*allowed: str, metadata: bool = False) -> Callable[[Request], None]:
    """Refuse query parameters the route does not implement; `metadata` allows the
    `metadata[key]=value` filters (and `metadata=null`)."""

    def check(request: Request) -> None:
        given = set(request.query_params)
        if metadata:
            given -= {k for k in given if k == "metadata" or _METADATA_KEY.fullmatch(k)}
        unknown = sorted(given - set(allowed))
        if unknown:
            raise BadRequest(
                f"unsupported query parameter {unknown[0]!r}: this route takes "
                f"{', '.join(allowed) or 'none'}",
                code="unsupported_parameter",
                param=unknown[0],
            )

    return check


_PAGED = [Depends(_only_query("after", "limit"))]
_NO_QUERY = [Depends(_only_query())]


def _metadata_filter(request: Request) -> dict[str, str] | bool | None:
    """`metadata[k]=v` pairs, None for `metadata=null`, False for no filter."""
    query = request.query_params
    pairs = {
        m.group(1): value
        for key, value in query.multi_items()
        if (m := _METADATA_KEY.fullmatch(key)) is not None
    }
    if "metadata" in query:
        if query["metadata"] != "null" or pairs:
            raise BadRequest(
                "metadata: filter with metadata[key]=value pairs, or metadata=null alone for "
                "jobs without metadata",
                param="metadata",
            )
        return None
    bad = [k for k in pairs if '"' in k]
    if bad:
        raise BadRequest(
            f'metadata key {bad[0]!r}: a key with " cannot be filtered on', param="metadata"
        )
    return pairs or False


def _page(data: list, has_more: bool) -> dict:
    return {
        "data": data,
        "has_more": has_more,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }


@router.post(
    "",
    response_model=FineTuningJob,
    status_code=201,
    dependencies=_NO_QUERY,
    responses={200: {"model": FineTuningJob, "description": "a retry of a create"}, **_ERRORS},
)
async def create_job(
    body: FineTuningJobCreate,
    response: Response,
    service: FineTuningDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    x_stainless_retry_count: RetryCount = None,
) -> FineTuningJob:
    """`fine_tuning.jobs.create`: translate to a JobSpec and queue it (docs/API.md)."""
    job, created = await service.create(
        body, idempotency_key=idempotency_key, retried=bool(x_stainless_retry_count)
    )
    response.status_code = 201 if created else 200
    return job


@router.get(
    "",
    response_model=OpenAIList[FineTuningJob],
    dependencies=[Depends(_only_query("after", "limit", metadata=True))],
)
async def list_jobs(
    request: Request,
    service: FineTuningDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> OpenAIList[FineTuningJob]:
    """Jobs of both APIs, newest first; `metadata[key]=value` keeps those with the pairs."""
    metadata = _metadata_filter(request)
    jobs, has_more = await service.list(after=after, limit=limit, metadata=metadata)
    return OpenAIList[FineTuningJob](**_page(jobs, has_more))


@router.get("/{job_id}", response_model=FineTuningJob, responses=_ERRORS, dependencies=_NO_QUERY)
async def retrieve_job(job_id: JobId, service: FineTuningDep) -> FineTuningJob:
    return await service.get(job_id)


@router.post(
    "/{job_id}/cancel", response_model=FineTuningJob, responses=_ERRORS, dependencies=_NO_QUERY
)
async def cancel_job(
    job_id: JobId, service: FineTuningDep, x_stainless_retry_count: RetryCount = None
) -> FineTuningJob:
    return await service.cancel(job_id, retried=bool(x_stainless_retry_count))


@router.post(
    "/{job_id}/pause", response_model=FineTuningJob, responses=_ERRORS, dependencies=_NO_QUERY
)
async def pause_job(job_id: JobId, service: FineTuningDep) -> FineTuningJob:
    """Checkpoint and stop; the job reads `running` until the checkpoint is written."""
    return await service.pause(job_id)


@router.post(
    "/{job_id}/resume", response_model=FineTuningJob, responses=_ERRORS, dependencies=_NO_QUERY
)
async def resume_job(
    job_id: JobId, service: FineTuningDep, x_stainless_retry_count: RetryCount = None
) -> FineTuningJob:
    return await service.resume(job_id, retried=bool(x_stainless_retry_count))


@router.get(
    "/{job_id}/events",
    response_model=OpenAIList[FineTuningJobEvent],
    responses=_ERRORS,
    dependencies=_PAGED,
)
async def list_events(
    job_id: JobId,
    service: FineTuningDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> OpenAIList[FineTuningJobEvent]:
    """Newest first; `after` (an event id) pages on to older events."""
    events, has_more = await service.events(job_id, after=after, limit=limit)
    return OpenAIList[FineTuningJobEvent](**_page(events, has_more))


@router.get(
    "/{job_id}/checkpoints",
    response_model=OpenAIList[FineTuningJobCheckpoint],
    responses=_ERRORS,
    dependencies=_PAGED,
)
async def list_checkpoints(
    job_id: JobId,
    service: FineTuningDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> OpenAIList[FineTuningJobCheckpoint]:
    """Committed checkpoints still on disk, newest first."""
    checkpoints, has_more = await service.checkpoints(job_id, after=after, limit=limit)
    return OpenAIList[FineTuningJobCheckpoint](**_page(checkpoints, has_more))
