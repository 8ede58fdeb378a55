"""A finished job's results file: its per-step losses as CSV, read back from its events.

The OpenAI fine-tuning API hands these out as files (`result_files`, purpose
`fine-tune-results`). Here they are not stored: the CSV is rendered from the job's
`metrics` events whenever it is asked for, so it always agrees with the events, and every
succeeded job has one, whichever API submitted it. A result file's id is derived from its
job's id, so no table maps one to the other.
"""

from __future__ import annotations

import csv
import hashlib
import io

from rp_service.errors import NotFound
from rp_service.jobs.store import FileRecord, JobRecord, Store

__all__ = [
    "RESULT_COLUMNS",
    "RESULT_PREFIX",
    "ResultFiles",
    "is_result_file_id",
    "result_file_id",
]

RESULT_PREFIX = "file-results-"
RESULT_COLUMNS = ("step", "train_loss", "valid_loss")
_PAGE = 5000


def result_file_id(job_id: str) -> str:
    """`job-abc` -> `file-results-abc`."""
    return RESULT_PREFIX + job_id.removeprefix("job-")


def is_result_file_id(file_id: str) -> bool:
    return file_id.startswith(RESULT_PREFIX)


def _cell(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    return repr(float(value)) if isinstance(value, float) else str(value)


class ResultFiles:
    """Renders and describes result files; blocking (call from a thread)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def job_of(self, file_id: str) -> JobRecord:
        """The succeeded job a result file belongs to; NotFound otherwise."""
        job = self.store.get_job("job-" + file_id.removeprefix(RESULT_PREFIX))
        if job is None or job.status != "succeeded":
            raise NotFound(
                f"no file with id {file_id!r} (a results file exists once its job has succeeded)",
                param="file_id",
            )
        return job

    def csv_bytes(self, job_id: str) -> bytes:
        """`step,train_loss,valid_loss`, one row per metrics event, empty where unmeasured."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(RESULT_COLUMNS)
        after = 0
        while True:
            page = self.store.list_events(job_id, after=after, limit=_PAGE, type_="metrics")
            for event in page:
                writer.writerow([_cell(event.data.get(name)) for name in RESULT_COLUMNS])
            if len(page) < _PAGE:
                return out.getvalue().encode()
            after = page[-1].id

    def record(self, file_id: str) -> tuple[FileRecord, bytes]:
        """A file record (as an upload's) describing the results file, and its content."""
        job = self.job_of(file_id)
        content = self.csv_bytes(job.id)
        record = FileRecord(
            id=file_id,
            filename=f"{job.id}-results.csv",
            bytes=len(content),
            sha256=hashlib.sha256(content).hexdigest(),
            line_count=content.count(b"\n") - 1,
            format="csv",
            created_at=job.finished_at or job.created_at,
            path="",
        )
        return record, content

    def page(self, *, after: str | None, limit: int) -> tuple[list[FileRecord], bool]:
        """Results files of succeeded jobs, newest job first; `after` is a results file id."""
        after_job = "job-" + after.removeprefix(RESULT_PREFIX) if after else None
        jobs, has_more = self.store.list_jobs(status="succeeded", after=after_job, limit=limit)
        return [self.record(result_file_id(j.id))[0] for j in jobs], has_more
