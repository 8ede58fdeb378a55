"""Dataset files: upload (checked), list, read, download, delete.

One route per operation serves both the native API and OpenAI's files API (its SDK posts
`purpose`, reads `purpose`/`status`, and sends `x-stainless-retry-count` on retries); a
finished job's results file (`file-results-...`, see rp_service/results.py) is read here too.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import (
    APIRouter,
    Form,
    Header,
    Path,
    Query,
    Request,
    Response,
    UploadFile,
)
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from rp_service.api.deps import FilesDep, ServicesDep
from rp_service.errors import BadRequest, DiskFull
from rp_service.jobs.files import RETRY_WINDOW_S
from rp_service.jobs.results import ResultFiles, is_result_file_id
from rp_service.jobs.retention import check_free_space
from rp_service.jobs.store import FileRecord
from rp_service.schemas import ErrorEnvelope, File, FileDeleted, ListPage


def _out_of_space(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class _SpoolRoute(APIRoute):
    """FastAPI answers any error while it spools a multipart body with 400 "There was an
    error parsing the body"; a spool that ran out of space is the disk's fault: 507."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPException as exc:
                if _out_of_space(exc):
                    raise DiskFull(
                        "the daemon's disk is full: the upload could not be received (its "
                        "spool in RP_DATA_DIR/tmp ran out of space); free space in "
                        "RP_DATA_DIR (delete finished jobs with DELETE /v1/jobs/{id})",
                        param="file",
                    ) from None
                raise

        return run


router = APIRouter(prefix="/v1/files", tags=["files"], route_class=_SpoolRoute)

FileId = Annotated[str, Path(min_length=1, max_length=200)]
_404 = {404: {"model": ErrorEnvelope, "description": "no such file"}}
_FORM_FIELDS = frozenset({"file", "format", "purpose"})


def _file(record: FileRecord) -> File:
    public = File.model_validate(record, from_attributes=True)
    if is_result_file_id(record.id):
        public.purpose = "fine-tune-results"
    return public


@router.post(
    "",
    response_model=File,
    status_code=201,
    responses={
        200: {"model": File, "description": "a retried upload that was already stored"},
        400: {"model": ErrorEnvelope, "description": "an unsupported purpose or form field"},
        413: {"model": ErrorEnvelope, "description": "over RP_MAX_UPLOAD_BYTES"},
        507: {"model": ErrorEnvelope, "description": "disk_full: below RP_MIN_FREE_BYTES"},
        422: {"model": ErrorEnvelope, "description": "a bad line; details.line names it"},
    },
)
async def upload_file(
    request: Request,
    response: Response,
    file: UploadFile,
    files: FilesDep,
    services: ServicesDep,
    format: Annotated[
        Literal["auto", "text", "chat", "prompt_completion", "preference", "prompt"],
        Form(description="jsonl format (preference: DPO pairs)"),
    ] = "auto",
    purpose: Annotated[
        str | None, Form(max_length=100, description='OpenAI\'s files API: "fine-tune"')
    ] = None,
    x_stainless_retry_count: Annotated[int | None, Header(ge=0, le=1000)] = None,
) -> File:
    """Upload a jsonl dataset; each line is checked against the format."""
    unknown = sorted(set((await request.form()).keys()) - _FORM_FIELDS)
    if unknown:
        raise BadRequest(
            f"unsupported form field(s) {', '.join(unknown)}: an upload takes file, purpose "
            "and format",
            code="unsupported_parameter",
            param=unknown[0],
        )
    if purpose is not None and purpose != "fine-tune":
        raise BadRequest(
            f"purpose {purpose!r} is not supported: this daemon stores datasets for "
            'fine-tuning only; use purpose="fine-tune"',
            code="unsupported_purpose",
            param="purpose",
        )
    # The body is spooled by now (FastAPI reads a form before the route runs); storing it
    # writes its size again, which must leave the floor free.
    await asyncio.to_thread(
        check_free_space, services.settings, what="the upload", need=file.size or 0
    )
    retry_since = int(time.time()) - RETRY_WINDOW_S if x_stainless_retry_count else None
    record, created = await asyncio.to_thread(
        files.save,
        file.file,
        filename=file.filename or "upload.jsonl",
        fmt=format,
        retry_since=retry_since,
    )
    response.status_code = 201 if created else 200
    return _file(record)


@router.get("", response_model=ListPage[File])
async def list_files(
    services: ServicesDep,
    after: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
    purpose: Annotated[
        Literal["fine-tune", "fine-tune-results"],
        Query(description="fine-tune-results: the results files of succeeded jobs"),
    ] = "fine-tune",
    order: Annotated[Literal["desc"], Query(description="newest first")] = "desc",
) -> ListPage[File]:
    if purpose == "fine-tune":
        records, has_more = await asyncio.to_thread(services.files.list, after=after, limit=limit)
    else:
        records, has_more = await asyncio.to_thread(
            ResultFiles(services.store).page, after=after, limit=limit
        )
    data = [_file(r) for r in records]
    return ListPage[File](
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{file_id}", response_model=File, responses=_404)
async def get_file(file_id: FileId, services: ServicesDep) -> File:
    if is_result_file_id(file_id):
        record, _ = await asyncio.to_thread(ResultFiles(services.store).record, file_id)
    else:
        record = await asyncio.to_thread(services.files.get, file_id)
    return _file(record)


@router.get(
    "/{file_id}/content",
    response_class=Response,
    responses={200: {"content": {"application/jsonl": {}, "text/csv": {}}}, **_404},
)
async def file_content(file_id: FileId, services: ServicesDep) -> Response:
    """The file's bytes: an upload as stored, a results file as CSV."""
    if is_result_file_id(file_id):
        _, content = await asyncio.to_thread(ResultFiles(services.store).record, file_id)
        return Response(content, media_type="text/csv")
    record = await asyncio.to_thread(services.files.get, file_id)
    return FileResponse(record.path, media_type="application/jsonl", filename=record.filename)


@router.delete(
    "/{file_id}",
    response_model=FileDeleted,
    responses={
        **_404,
        400: {"model": ErrorEnvelope, "description": "a results file"},
        409: {"model": ErrorEnvelope, "description": "file_in_use: unfinished jobs use it"},
    },
)
async def delete_file(file_id: FileId, files: FilesDep) -> FileDeleted:
    if is_result_file_id(file_id):
        raise BadRequest(
            f"{file_id} is a job's results file, rendered from the job's events; it cannot "
            "be deleted on its own",
            code="file_not_deletable",
            param="file_id",
        )
    record = await asyncio.to_thread(files.delete, file_id)
    return FileDeleted(id=record.id)
