"""Jobs: submit, list, read, cancel/pause/resume, metric series, logs, checkpoints, export."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response
from fastapi.responses import PlainTextResponse, StreamingResponse

from rp_service.api.deps import OrchestratorDep, OutputsDep
from rp_service.jobs.store import JobRecord
from rp_service.schemas import (
    MAX_INT64,
    Checkpoint,
    ErrorEnvelope,
    Export,
    ExportRequest,
    Job,
    JobDeleted,
    JobMetrics,
    JobSpec,
    JobStatus,
    ListPage,
)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobId = Annotated[str, Path(min_length=1, max_length=200, description="A job id, job-...")]
_ERRORS = {
    404: {"model": ErrorEnvelope, "description": "no such job"},
    409: {"model": ErrorEnvelope, "description": "illegal transition"},
}


def _job(record: JobRecord) -> Job:
    return Job.model_validate(record, from_attributes=True)


@router.post(
    "",
    response_model=Job,
    status_code=201,
    responses={200: {"model": Job, "description": "an idempotent retry"}, **_ERRORS},
)
async def create_job(
    spec: JobSpec,
    response: Response,
    orchestrator: OrchestratorDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Job:
    """Submit a JobSpec. With an `Idempotency-Key`, a retry returns the same job (200)."""
    record, created = await orchestrator.submit(spec, idempotency_key=idempotency_key)
    response.status_code = 201 if created else 200
    return _job(record)


@router.get("", response_model=ListPage[Job])
async def list_jobs(
    orchestrator: OrchestratorDep,
    status: JobStatus | None = None,
    after: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[Job]:
    """Jobs, newest first; `after` is the last id of the previous page."""
    records, has_more = await orchestrator.list(status=status, after=after, limit=limit)
    data = [_job(r) for r in records]
    return ListPage[Job](
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{job_id}", response_model=Job, responses=_ERRORS)
async def get_job(job_id: JobId, orchestrator: OrchestratorDep) -> Job:
    return _job(await orchestrator.get(job_id))


@router.delete(
    "/{job_id}",
    response_model=JobDeleted,
    responses={
        404: {"model": ErrorEnvelope, "description": "no such job"},
        409: {"model": ErrorEnvelope, "description": "the job has not finished"},
    },
)
async def delete_job(job_id: JobId, orchestrator: OrchestratorDep) -> JobDeleted:
    """Delete a finished job: its checkpoints, outputs, log and events; then GET is 404."""
    job = await orchestrator.delete(job_id)
    return JobDeleted(id=job.id)


@router.post("/{job_id}/cancel", response_model=Job, responses=_ERRORS)
async def cancel_job(job_id: JobId, orchestrator: OrchestratorDep) -> Job:
    """Cancel: the worker is stopped within seconds and its GPUs are freed."""
    return _job(await orchestrator.cancel(job_id))


@router.post("/{job_id}/pause", response_model=Job, responses=_ERRORS)
async def pause_job(job_id: JobId, orchestrator: OrchestratorDep) -> Job:
    """Pause: the worker checkpoints and exits, releasing its GPUs."""
    return _job(await orchestrator.pause(job_id))


@router.post(
    "/{job_id}/resume",
    response_model=Job,
    responses={**_ERRORS, 429: {"model": ErrorEnvelope, "description": "queue_full"}},
)
async def resume_job(job_id: JobId, orchestrator: OrchestratorDep) -> Job:
    """Resume a paused job: back in the queue, then on from its last checkpoint."""
    return _job(await orchestrator.resume(job_id))


@router.get("/{job_id}/metrics", response_model=JobMetrics, responses=_ERRORS)
async def job_metrics(job_id: JobId, outputs: OutputsDep) -> JobMetrics:
    """Per-step series for plots, one list per column."""
    return JobMetrics(job_id=job_id, columns=await outputs.metric_series(job_id))


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}}, **_ERRORS},
)
async def job_logs(
    job_id: JobId,
    outputs: OutputsDep,
    offset: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
    follow: bool = False,
) -> Response:
    """The worker's log from byte `offset`; `x-next-offset` says where to go on."""
    if follow:
        stream = await outputs.follow_log(job_id, offset=offset)
        return StreamingResponse(stream, media_type="text/plain")
    data, next_offset = await outputs.read_log(job_id, offset=offset)
    return Response(data, media_type="text/plain", headers={"x-next-offset": str(next_offset)})


@router.get("/{job_id}/checkpoints", response_model=ListPage[Checkpoint], responses=_ERRORS)
async def list_checkpoints(job_id: JobId, outputs: OutputsDep) -> ListPage[Checkpoint]:
    records = await outputs.checkpoints(job_id)
    data = [Checkpoint.model_validate(r, from_attributes=True) for r in records]
    return ListPage[Checkpoint](
        data=data,
        has_more=False,
        first_id=data[0].step if data else None,
        last_id=data[-1].step if data else None,
    )


@router.get(
    "/{job_id}/checkpoints/{step}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, **_ERRORS},
)
async def checkpoint_content(
    job_id: JobId, step: Annotated[int, Path(ge=0, le=MAX_INT64)], outputs: OutputsDep
) -> StreamingResponse:
    """Download one checkpoint directory as a tar stream."""
    stream = await outputs.checkpoint_tar(job_id, step)
    return StreamingResponse(
        stream,
        media_type="application/x-tar",
        headers={"content-disposition": f'attachment; filename="{job_id}-step{step}.tar"'},
    )


@router.post(
    "/{job_id}/export",
    response_model=Export,
    responses={
        **_ERRORS,
        422: {"model": ErrorEnvelope, "description": "llama.cpp cannot load this model"},
    },
)
async def export_model(job_id: JobId, request: ExportRequest, outputs: OutputsDep) -> Export:
    """Write a succeeded job's model as GGUF (with an Ollama Modelfile) on the daemon's disk."""
    return await outputs.export(job_id, request)
