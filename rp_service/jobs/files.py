"""Dataset uploads: stored once, hashed, counted, and format-checked line by line."""

from __future__ import annotations

import errno
import hashlib
import secrets
import time
from pathlib import Path
from typing import IO

from rp_service.durable import replacing
from rp_service.errors import DiskFull, InvalidRequest, NotFound, RequestTooLarge
from rp_service.jobs.openai_store import OpenAIStore
from rp_service.jobs.store import FileRecord, Store

__all__ = ["FORMATS", "RETRY_WINDOW_S", "FileService"]

FORMATS = ("text", "chat", "prompt_completion", "preference", "prompt")
# How far back a client's retry (the OpenAI SDK's x-stainless-retry-count > 0) looks for its
# first attempt: longer than that SDK's default timeout (600 s) plus its back-off.
RETRY_WINDOW_S = 900
_CHUNK_BYTES = 1 << 20


def _check_lines(path: Path, fmt: str) -> tuple[int, str]:
    """Record count and format of a stored jsonl file; InvalidRequest names the first bad line.

    The line rules are rp_service.data.formats', the ones training applies, so an upload that
    passes here cannot fail later on its format. Imported here: data.py loads torch.
    """
    from rp_service.data.formats import DataFormatError, validate_jsonl

    try:
        return validate_jsonl(path, fmt)
    except DataFormatError as exc:
        line = exc.line or 1
        message = str(exc) if exc.line else f"{exc.message}: upload jsonl, one JSON object a line"
        raise InvalidRequest(
            message, code="invalid_file_format", param="file", details={"line": line}
        ) from None


def _base_name(filename: str) -> str:
    """The client's file name without any directory part (either slash), at most 255 chars."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable())
    return name[:255] if name not in ("", ".", "..") else "upload.jsonl"


class _LineMeter:
    """Counts the bytes of the current line across chunks; refuses one over the limit, so a
    huge line is never held in memory (the format check reads a line at a time)."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self.line = 1
        self.current = 0

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            self._grow(newline - start)
            self.line += 1
            self.current = 0
            start = newline + 1
        self._grow(len(chunk) - start)

    def _grow(self, n: int) -> None:
        self.current += n
        if self.current > self.max_line_bytes:
            raise InvalidRequest(
                f"line {self.line} is longer than RP_MAX_LINE_BYTES={self.max_line_bytes} "
                "bytes; split the record or ask the operator to raise the limit",
                code="line_too_long",
                param="file",
                details={"line": self.line},
            )


class FileService:
    """Saves uploads under `files_dir` and records them in the store."""

    def __init__(
        self,
        store: Store,
        files_dir: Path,
        *,
        max_upload_bytes: int,
        max_line_bytes: int = 16 << 20,
    ) -> None:
        self.store = store
        self.files_dir = files_dir
        self.max_upload_bytes = max_upload_bytes
        self.max_line_bytes = max_line_bytes

    def save(
        self,
        source: IO[bytes],
        *,
        filename: str,
        fmt: str = "auto",
        retry_since: int | None = None,
    ) -> tuple[FileRecord, bool]:
        """Copy `source` into the store while checking it; blocking (call it in a thread).

        Returns the record and whether it was stored now. With `retry_since` (the request
        is a client's retry), an upload of the same bytes under the same name since then
        is returned instead of a second copy: the first attempt may have been stored
        before its response was lost.

        Raises InvalidRequest naming the first bad line, RequestTooLarge over the limit.
        """
        if fmt not in ("auto", *FORMATS):
            raise InvalidRequest(
                f"format must be one of auto, {', '.join(FORMATS)}; got {fmt!r}", param="format"
            )
        self.files_dir.mkdir(parents=True, exist_ok=True)
        file_id = "file-" + secrets.token_hex(12)
        final = self.files_dir / f"{file_id}.jsonl"
        partial = final.with_suffix(".partial")
        digest = hashlib.sha256()
        meter = _LineMeter(self.max_line_bytes)
        size = 0
        try:
            # Durable before its row says it exists; a crash leaves at most the .partial
            # name, which the next daemon removes (rp_service.datadir).
            with replacing(final, tmp=partial) as tmp:
                with tmp.open("wb") as out:
                    while chunk := source.read(_CHUNK_BYTES):
                        size += len(chunk)
                        if size > self.max_upload_bytes:
                            raise RequestTooLarge(
                                "the upload is over "
                                f"RP_MAX_UPLOAD_BYTES={self.max_upload_bytes} bytes",
                                param="file",
                            )
                        meter.feed(chunk)
                        digest.update(chunk)
                        out.write(chunk)
                records, detected = _check_lines(tmp, fmt)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFull(
                    "the daemon's disk is full: the upload was not stored; free space in "
                    "RP_DATA_DIR (delete finished jobs with DELETE /v1/jobs/{id})",
                    param="file",
                ) from None
            raise
        if retry_since is not None:
            earlier = OpenAIStore(self.store).find_retried_file(
                digest.hexdigest(), filename[:255] or "upload.jsonl", since=retry_since
            )
            if earlier is not None:
                final.unlink(missing_ok=True)
                return earlier, False
        record = FileRecord(
            id=file_id,
            filename=_base_name(filename),
            bytes=size,
            sha256=digest.hexdigest(),
            line_count=records,
            format=detected,
            created_at=int(time.time()),
            path=str(final.resolve()),
        )
        try:
            return self.store.add_file(record), True
        except BaseException:
            final.unlink(missing_ok=True)
            raise

    def get(self, file_id: str) -> FileRecord:
        record = self.store.get_file(file_id)
        if record is None:
            raise NotFound(f"no file with id {file_id!r}", code="file_not_found", param="file_id")
        return record

    def list(self, *, after: str | None, limit: int) -> tuple[list[FileRecord], bool]:
        return self.store.list_files(after=after, limit=limit)

    def delete(self, file_id: str) -> FileRecord:
        record = self.store.delete_file(file_id)
        if record is None:
            raise NotFound(f"no file with id {file_id!r}", code="file_not_found", param="file_id")
        Path(record.path).unlink(missing_ok=True)
        return record
