"""`client.files` (datasets) and `client.checkpoints` (a job's saved states), sync and async."""

from __future__ import annotations

import builtins
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ._base import _params, _q
from .models import Checkpoint, File, FileDeleted, Page

if TYPE_CHECKING:
    from ._client import AsyncClient, Client

__all__ = ["AsyncCheckpoints", "AsyncFiles", "Checkpoints", "FileInput", "Files"]

FileInput = str | os.PathLike[str] | tuple[str, bytes | IO[bytes]]


def _file_part(file: FileInput) -> tuple[str, Any, IO[bytes] | None]:
    """(filename, content, handle to close) for a multipart upload."""
    if isinstance(file, tuple):
        name, content = file
        return name, content, None
    path = Path(file)
    handle = path.open("rb")
    return path.name, handle, handle


def _download_target(job_id: str, step: int, dest: str | os.PathLike[str] | None) -> Path:
    """Where a checkpoint tar goes: `dest` itself, or `<job>-step<N>.tar` inside it when it
    is a folder, or names one by a trailing slash (created then; `Path` drops the slash)."""
    name = f"{job_id}-step{step}.tar"
    if dest is None:
        return Path(name)
    path = Path(dest)
    if os.fspath(dest).endswith(tuple({"/", os.sep})):
        path.mkdir(parents=True, exist_ok=True)
    return path / name if path.is_dir() else path


class Files:
    """`client.files`: datasets uploaded to the daemon."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def upload(self, file: FileInput, *, format: str | None = None) -> File:
        """Uploads a jsonl dataset: a path, or `(filename, bytes or binary file)`."""
        name, content, handle = _file_part(file)
        try:
            response = self._client._send(
                "POST",
                "/v1/files",
                files={"file": (name, content, "application/jsonl")},
                data=_params(format=format),
            )
        finally:
            if handle is not None:
                handle.close()
        return self._client._parse(File, response)

    def list(self) -> Iterator[File]:
        after: str | None = None
        while True:
            response = self._client._send("GET", "/v1/files", params=_params(after=after))
            page = self._client._parse(Page[File], response)
            yield from page.data
            after = self._client._next_cursor(page, after)
            if after is None:
                return

    def get(self, file_id: str) -> File:
        return self._client._parse(File, self._client._send("GET", f"/v1/files/{_q(file_id)}"))

    def delete(self, file_id: str) -> FileDeleted:
        response = self._client._send("DELETE", f"/v1/files/{_q(file_id)}")
        return self._client._parse(FileDeleted, response)


class Checkpoints:
    """`client.checkpoints`: a job's saved checkpoints."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self, job_id: str) -> builtins.list[Checkpoint]:
        """The job's checkpoints, oldest step first."""
        response = self._client._send("GET", f"/v1/jobs/{_q(job_id)}/checkpoints")
        return sorted(self._client._parse(Page[Checkpoint], response).data, key=lambda c: c.step)

    def download(self, job_id: str, step: int, dest: str | os.PathLike[str] | None = None) -> Path:
        """Saves the checkpoint as a tar file (default `./<job>-step<N>.tar`); returns its path."""
        target = _download_target(job_id, step, dest)
        partial = target.with_name(target.name + ".part")
        with (
            self._client._stream(
                "GET", f"/v1/jobs/{_q(job_id)}/checkpoints/{int(step)}/content"
            ) as response,
            partial.open("wb") as out,
        ):
            for chunk in response.iter_bytes():
                out.write(chunk)
        partial.replace(target)
        return target


class AsyncFiles:
    """`client.files` of `AsyncClient`; see `Files`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def upload(self, file: FileInput, *, format: str | None = None) -> File:
        name, content, handle = _file_part(file)
        try:
            response = await self._client._send(
                "POST",
                "/v1/files",
                files={"file": (name, content, "application/jsonl")},
                data=_params(format=format),
            )
        finally:
            if handle is not None:
                handle.close()
        return self._client._parse(File, response)

    async def list(self) -> AsyncIterator[File]:
        after: str | None = None
        while True:
            response = await self._client._send("GET", "/v1/files", params=_params(after=after))
            page = self._client._parse(Page[File], response)
            for file in page.data:
                yield file
            after = self._client._next_cursor(page, after)
            if after is None:
                return

    async def get(self, file_id: str) -> File:
        response = await self._client._send("GET", f"/v1/files/{_q(file_id)}")
        return self._client._parse(File, response)

    async def delete(self, file_id: str) -> FileDeleted:
        response = await self._client._send("DELETE", f"/v1/files/{_q(file_id)}")
        return self._client._parse(FileDeleted, response)


class AsyncCheckpoints:
    """`client.checkpoints` of `AsyncClient`; see `Checkpoints`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self, job_id: str) -> builtins.list[Checkpoint]:
        response = await self._client._send("GET", f"/v1/jobs/{_q(job_id)}/checkpoints")
        return sorted(self._client._parse(Page[Checkpoint], response).data, key=lambda c: c.step)

    async def download(
        self, job_id: str, step: int, dest: str | os.PathLike[str] | None = None
    ) -> Path:
        target = _download_target(job_id, step, dest)
        partial = target.with_name(target.name + ".part")
        async with self._client._stream(
            "GET", f"/v1/jobs/{_q(job_id)}/checkpoints/{int(step)}/content"
        ) as response:
            with partial.open("wb") as out:
                async for chunk in response.aiter_bytes():
                    out.write(chunk)
        partial.replace(target)
        return target
