"""Dataset files: upload (checked), list, read, delete."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Form, Path, Query, UploadFile

from rp_service.api.deps import FilesDep
from rp_service.schemas import ErrorEnvelope, File, FileDeleted, ListPage

router = APIRouter(prefix="/v1/files", tags=["files"])

FileId = Annotated[str, Path(min_length=1, max_length=200)]
_404 = {404: {"model": ErrorEnvelope, "description": "no such file"}}


@router.post(
    "",
    response_model=File,
    status_code=201,
    responses={
        413: {"model": ErrorEnvelope, "description": "over RP_MAX_UPLOAD_BYTES"},
        422: {"model": ErrorEnvelope, "description": "a bad line; details.line names it"},
    },
)
async def upload_file(
    file: UploadFile,
    files: FilesDep,
    format: Annotated[
        Literal["auto", "text", "chat", "prompt_completion"], Form(description="jsonl format")
    ] = "auto",
) -> File:
    """Upload a jsonl dataset; each line is checked against the format."""
    record = await asyncio.to_thread(
        files.save, file.file, filename=file.filename or "upload.jsonl", fmt=format
    )
    return File.model_validate(record, from_attributes=True)


@router.get("", response_model=ListPage[File])
async def list_files(
    files: FilesDep,
    after: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
) -> ListPage[File]:
    records, has_more = await asyncio.to_thread(files.list, after=after, limit=limit)
    data = [File.model_validate(r, from_attributes=True) for r in records]
    return ListPage[File](
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{file_id}", response_model=File, responses=_404)
async def get_file(file_id: FileId, files: FilesDep) -> File:
    record = await asyncio.to_thread(files.get, file_id)
    return File.model_validate(record, from_attributes=True)


@router.delete("/{file_id}", response_model=FileDeleted, responses=_404)
async def delete_file(file_id: FileId, files: FilesDep) -> FileDeleted:
    record = await asyncio.to_thread(files.delete, file_id)
    return FileDeleted(id=record.id)
