"""The OpenAI-compatible API's side of the store: its job table and the reads it needs.

Shares `Store`'s connections (and so its SQLite file and threads' connections); the
native API's tables and SQL stay in `rp_service.jobs.store`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rp_service.jobs.store import (
    EventRecord,
    FileRecord,
    JobRecord,
    Store,
    _event_from_row,
    _file_from_row,
    _job_from_row,
)

__all__ = ["OpenAIJobRecord", "OpenAIStore"]

# What the OpenAI fine-tuning API keeps about a job beyond the JobSpec (model name as
# given, suffix, metadata, the hyperparameters as resolved, the request's hash for retry
# detection). A table of its own, created on first use with IF NOT EXISTS rather than as
# a schema migration: a database from before opens unchanged, and an older daemon opening
# a newer database just never reads the table.
_OPENAI_SCHEMA = """
CREATE TABLE IF NOT EXISTS openai_jobs (
    job_id TEXT PRIMARY KEY,
    body_sha256 TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    fields TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS openai_jobs_body ON openai_jobs (body_sha256, created_at);
"""


@dataclass(slots=True)
class OpenAIJobRecord:
    job_id: str
    body_sha256: str
    created_at: int
    fields: dict[str, Any]


def _openai_job_from_row(row: sqlite3.Row) -> OpenAIJobRecord:
    return OpenAIJobRecord(
        job_id=row["job_id"],
        body_sha256=row["body_sha256"],
        created_at=row["created_at"],
        fields=json.loads(row["fields"]),
    )


class OpenAIStore:
    """The OpenAI API's side of the store: its job table, and the reads it needs that the
    native API does not (events newest first, a retried upload). Shares `Store`'s
    connections, so it sees every write of the native API at once."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._created = False

    def _conn(self) -> sqlite3.Connection:
        conn = self.store._conn()
        if not self._created:
            conn.executescript(_OPENAI_SCHEMA)  # idempotent, so a race between threads is harmless
            self._created = True
        return conn

    def add_job(self, record: OpenAIJobRecord) -> None:
        self._conn().execute(
            "INSERT OR REPLACE INTO openai_jobs (job_id, body_sha256, created_at, fields) "
            "VALUES (?, ?, ?, ?)",
            (record.job_id, record.body_sha256, record.created_at, json.dumps(record.fields)),
        )

    def get_jobs(self, job_ids: Iterable[str]) -> dict[str, OpenAIJobRecord]:
        """The OpenAI records of these jobs; jobs made through the native API have none."""
        wanted = list(job_ids)
        if not wanted:
            return {}
        marks = ",".join("?" * len(wanted))
        rows = (
            self._conn()
            .execute(f"SELECT * FROM openai_jobs WHERE job_id IN ({marks})", wanted)
            .fetchall()
        )
        return {r["job_id"]: _openai_job_from_row(r) for r in rows}

    def find_retried_job(self, body_sha256: str, *, since: int) -> OpenAIJobRecord | None:
        """The newest job created since `since` from a request body with this hash."""
        row = (
            self._conn()
            .execute(
                "SELECT * FROM openai_jobs WHERE body_sha256 = ? AND created_at >= ? "
                "ORDER BY created_at DESC LIMIT 1",
                (body_sha256, since),
            )
            .fetchone()
        )
        return _openai_job_from_row(row) if row is not None else None

    def list_jobs_by_metadata(
        self, metadata: dict[str, str] | None, *, after: str | None, limit: int
    ) -> tuple[list[JobRecord], bool]:
        """Jobs newest first whose metadata has every pair given; None: jobs without metadata
        (those of the native API included). Keys are bound as JSON paths, never spliced."""
        sql = "SELECT j.* FROM jobs j LEFT JOIN openai_jobs o ON o.job_id = j.id WHERE "
        if metadata is None:
            where = ["json_extract(o.fields, '$.metadata') IS NULL"]
            args: list[Any] = []
        else:
            where = ["json_extract(o.fields, ?) = ?"] * len(metadata)
            args = [a for k, v in metadata.items() for a in (f'$.metadata."{k}"', v)]
        where.append("j.deleted_at IS NULL")  # a deleted job is gone from every listing
        if after is not None:
            where.append("j.seq < COALESCE((SELECT seq FROM jobs WHERE id = ?), -1)")
            args.append(after)
        sql += " AND ".join(where) + " ORDER BY j.seq DESC LIMIT ?"
        rows = self._conn().execute(sql, (*args, limit + 1)).fetchall()
        return [_job_from_row(r) for r in rows[:limit]], len(rows) > limit

    def list_events_desc(self, job_id: str, *, before: int | None, limit: int) -> list[EventRecord]:
        """Events newest first, with id < `before` (all when None): OpenAI's order."""
        sql = "SELECT * FROM events WHERE job_id = ?"
        args: list[Any] = [job_id]
        if before is not None:
            sql += " AND id < ?"
            args.append(before)
        sql += " ORDER BY id DESC LIMIT ?"
        rows = self._conn().execute(sql, (*args, limit)).fetchall()
        return [_event_from_row(r) for r in rows]

    def find_retried_file(self, sha256: str, filename: str, *, since: int) -> FileRecord | None:
        """The newest upload since `since` of the same bytes under the same name."""
        row = (
            self._conn()
            .execute(
                "SELECT * FROM files WHERE sha256 = ? AND filename = ? AND created_at >= ? "
                "ORDER BY seq DESC LIMIT 1",
                (sha256, filename, since),
            )
            .fetchone()
        )
        return _file_from_row(row) if row is not None else None
