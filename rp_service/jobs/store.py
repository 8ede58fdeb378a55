"""All SQL: jobs, events, files, checkpoints and idempotency keys in SQLite (WAL).

Over ~600 lines: one schema and its migrations, kept with the queries that read it; the
OpenAI facade's side table lives in openai_store.py.

The OpenAI-compatible API's table and reads are in `rp_service.jobs.openai_store`.

One connection per thread (sqlite3 objects must not cross threads); async callers go
through `asyncio.to_thread`. Writes that must be atomic (a transition and its status
event, a job and its idempotency key) run in one `BEGIN IMMEDIATE` transaction.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rp_service.errors import Conflict, ServiceError, TooManyRequests
from rp_service.schemas import TERMINAL_STATUSES

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointRecord",
    "EventRecord",
    "FileRecord",
    "JobRecord",
    "Store",
    "StoreUnusable",
]

log = logging.getLogger(__name__)


# Each entry migrates from version i to i + 1; `PRAGMA user_version` records where a DB is.
_MIGRATIONS: list[str] = [
    """
    CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        name TEXT,
        status TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        started_at INTEGER,
        finished_at INTEGER,
        priority INTEGER NOT NULL DEFAULT 0,
        attempt INTEGER NOT NULL DEFAULT 0,
        restarts INTEGER NOT NULL DEFAULT 0,
        spec TEXT NOT NULL,
        progress TEXT NOT NULL DEFAULT '{}',
        metrics TEXT NOT NULL DEFAULT '{}',
        trained_tokens INTEGER NOT NULL DEFAULT 0,
        output_model_path TEXT,
        gpus TEXT NOT NULL DEFAULT '[]',
        error TEXT,
        worker_pid INTEGER,
        worker_started TEXT
    );
    CREATE INDEX jobs_status ON jobs (status, priority, seq);
    CREATE TABLE events (
        job_id TEXT NOT NULL,
        id INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        level TEXT NOT NULL,
        type TEXT NOT NULL,
        message TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (job_id, id)
    ) WITHOUT ROWID;
    CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        filename TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        sha256 TEXT NOT NULL,
        line_count INTEGER NOT NULL,
        format TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        path TEXT NOT NULL
    );
    CREATE TABLE checkpoints (
        job_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        path TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        metrics TEXT NOT NULL,
        PRIMARY KEY (job_id, step)
    ) WITHOUT ROWID;
    CREATE TABLE idempotency_keys (
        key TEXT PRIMARY KEY,
        body_sha256 TEXT NOT NULL,
        job_id TEXT NOT NULL,
        created_at INTEGER NOT NULL
    );
    """,
    # 2: the model's parameter counts {trainable, total}, reported by the worker.
    """
    ALTER TABLE jobs ADD COLUMN parameters TEXT;
    """,
    # 3: when a finished job was deleted (DELETE /v1/jobs/{id}): its row stays, so its id
    # and idempotency key are never reused, but no read returns it.
    """
    ALTER TABLE jobs ADD COLUMN deleted_at INTEGER;
    """,
    # 4: the engine options the submission mapped from the spec (EngineOptions.to_json),
    # handed to the worker at every launch; NULL for jobs queued before this column.
    """
    ALTER TABLE jobs ADD COLUMN options TEXT;
    """,
    # 5: how the job runs on several GPUs of the box, decided at submission
    # (rp_service.jobs.gpu_mode: {mode, ranks, reason}); NULL for jobs queued before it.
    """
    ALTER TABLE jobs ADD COLUMN gpu_mode TEXT;
    """,
]
SCHEMA_VERSION = len(_MIGRATIONS)

# Statuses of a job that will read its data files again (at launch or at a resume).
_FILE_HOLDING_STATUSES = ("validating", "queued", "running", "pausing", "paused")
_JSON_COLUMNS = {
    "spec",
    "progress",
    "metrics",
    "gpus",
    "error",
    "parameters",
    "options",
    "gpu_mode",
}
_JOB_COLUMNS = {
    "name",
    "status",
    "started_at",
    "finished_at",
    "priority",
    "attempt",
    "restarts",
    "progress",
    "metrics",
    "trained_tokens",
    "output_model_path",
    "gpus",
    "error",
    "worker_pid",
    "worker_started",
    "parameters",
}


@dataclass(slots=True)
class JobRecord:
    id: str
    status: str
    created_at: int
    spec: dict[str, Any]
    name: str | None = None
    priority: int = 0
    started_at: int | None = None
    finished_at: int | None = None
    attempt: int = 0
    restarts: int = 0
    progress: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    trained_tokens: int = 0
    output_model_path: str | None = None
    gpus: list[int] = field(default_factory=list)
    error: dict[str, Any] | None = None
    worker_pid: int | None = None
    worker_started: str | None = None
    seq: int = 0
    parameters: dict[str, int] | None = None
    deleted_at: int | None = None
    # EngineOptions.to_json() of the spec, mapped once at submission (None: queued before)
    options: dict[str, Any] | None = None
    # rp_service.jobs.gpu_mode.GpuMode.to_json(), decided at submission (None: queued before)
    gpu_mode: dict[str, Any] | None = None


@dataclass(slots=True)
class EventRecord:
    id: int
    job_id: str
    created_at: int
    level: str
    type: str
    message: str
    data: dict[str, Any]


@dataclass(slots=True)
class FileRecord:
    id: str
    filename: str
    bytes: int
    sha256: str
    line_count: int
    format: str
    created_at: int
    path: str


@dataclass(slots=True)
class CheckpointRecord:
    job_id: str
    step: int
    created_at: int
    path: str
    size_bytes: int
    metrics: dict[str, Any]


def _now() -> int:
    return int(time.time())


def _job_from_row(row: sqlite3.Row) -> JobRecord:
    values = {k: row[k] for k in row.keys()}  # noqa: SIM118 (sqlite3.Row is not a mapping)
    for key in _JSON_COLUMNS:
        if values[key] is not None:
            values[key] = json.loads(values[key])
    return JobRecord(**values)


def _event_from_row(row: sqlite3.Row) -> EventRecord:
    return EventRecord(
        id=row["id"],
        job_id=row["job_id"],
        created_at=row["created_at"],
        level=row["level"],
        type=row["type"],
        message=row["message"],
        data=json.loads(row["data"]),
    )


def _checkpoint_from_row(row: sqlite3.Row) -> CheckpointRecord:
    return CheckpointRecord(
        job_id=row["job_id"],
        step=row["step"],
        created_at=row["created_at"],
        path=row["path"],
        size_bytes=row["size_bytes"],
        metrics=json.loads(row["metrics"]),
    )


def _encode(key: str, value: Any) -> Any:
    return json.dumps(value) if key in _JSON_COLUMNS and value is not None else value


class StoreUnusable(ServiceError, RuntimeError):
    """The store file exists but is not a usable RoundPipe store; the daemon refuses to start."""

    status_code = 503
    default_code = "store_unusable"


class Store:
    """The daemon's database; safe to call from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()

    # ------------------------------------------------------------ connections

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front so concurrent writers queue, not deadlock."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def check_existing(self) -> None:
        """Refuse a file that is not this daemon's store, reading it only.

        Raises StoreUnusable for a file that is not SQLite, is damaged, or is another
        program's database; the file is never written, so nothing of it is lost.
        """
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        fix = f"move it away or point RP_DATA_DIR at another directory; {self.path} was not changed"
        try:
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
        except sqlite3.Error as exc:
            raise StoreUnusable(f"cannot open {self.path} ({exc}): {fix}") from exc
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        except sqlite3.DatabaseError as exc:
            raise StoreUnusable(
                f"{self.path} is not a RoundPipe store or is damaged ({exc}): {fix}"
            ) from exc
        finally:
            conn.close()
        if check != "ok":
            raise StoreUnusable(f"{self.path} is damaged (integrity check: {check}): {fix}")
        ours = {"jobs", "events", "files", "checkpoints", "idempotency_keys"}
        foreign = (version == 0 and tables) or (0 < version <= SCHEMA_VERSION and ours - tables)
        if foreign:  # a newer version is refused by open(), which says to upgrade
            raise StoreUnusable(
                f"{self.path} is an SQLite database of another program (schema version "
                f"{version}, tables {sorted(tables)[:8]}): {fix}"
            )

    def open(self) -> None:
        """Create the file if needed and bring its schema up to `SCHEMA_VERSION`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.check_existing()
        conn = self._conn()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema version {version}, newer than this daemon's "
                f"{SCHEMA_VERSION}: upgrade rp_service"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            log.info("store: migrating %s to schema version %d", self.path, target)
            # executescript commits on its own; user_version is set in the same script.
            conn.executescript(
                f"BEGIN;\n{_MIGRATIONS[target - 1]}\nPRAGMA user_version = {target};\nCOMMIT;"
            )

    def schema_version(self) -> int:
        return int(self._conn().execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        with self._all_lock:
            for conn in self._all:
                try:
                    conn.close()
                except sqlite3.ProgrammingError:
                    pass  # created in another thread: closed when that thread ends
            self._all.clear()
        self._local = threading.local()

    # ------------------------------------------------------------ jobs

    def create_job(
        self,
        job: JobRecord,
        *,
        idempotency_key: str | None = None,
        body_sha256: str | None = None,
        max_queued: int | None = None,
    ) -> tuple[JobRecord, bool, EventRecord | None]:
        """Insert a queued job and its first status event; with a key, at most once.

        Returns the job, whether it was created now, and its first event when it was.
        Raises Conflict when the key was used before with another body, TooManyRequests
        when `max_queued` jobs are queued already (counted in this transaction, so
        concurrent submissions cannot all pass one count).
        """
        with self._write() as conn:
            if idempotency_key is not None:
                row = conn.execute(
                    "SELECT body_sha256, job_id FROM idempotency_keys WHERE key = ?",
                    (idempotency_key,),
                ).fetchone()
                if row is not None:
                    if row["body_sha256"] != body_sha256:
                        raise Conflict(
                            "this Idempotency-Key was already used with a different request "
                            "body; use a new key for a new job",
                            code="idempotency_key_reused",
                            param="Idempotency-Key",
                        )
                    existing = conn.execute(
                        "SELECT * FROM jobs WHERE id = ?", (row["job_id"],)
                    ).fetchone()
                    if existing["deleted_at"] is not None:
                        raise Conflict(
                            f"this Idempotency-Key made job {row['job_id']}, which has been "
                            "deleted; use a new key for a new job",
                            code="idempotency_key_reused",
                            param="Idempotency-Key",
                        )
                    return _job_from_row(existing), False, None
            _check_queue_cap(conn, max_queued)
            conn.execute(
                "INSERT INTO jobs (id, name, status, created_at, priority, spec, progress, "
                "options, gpu_mode) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.id,
                    job.name,
                    job.status,
                    job.created_at,
                    job.priority,
                    json.dumps(job.spec),
                    json.dumps(job.progress),
                    _encode("options", job.options),
                    _encode("gpu_mode", job.gpu_mode),
                ),
            )
            if idempotency_key is not None:
                conn.execute(
                    "INSERT INTO idempotency_keys (key, body_sha256, job_id, created_at) "
                    "VALUES (?, ?, ?, ?)",
                    (idempotency_key, body_sha256, job.id, job.created_at),
                )
            event = self._insert_event(
                conn,
                job.id,
                type_="status",
                level="info",
                message=f"job {job.status}",
                data={"status": job.status, "previous": "validating"},
            )
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job.id,)).fetchone()
            return _job_from_row(row), True, event

    def get_job(self, job_id: str) -> JobRecord | None:
        row = (
            self._conn()
            .execute("SELECT * FROM jobs WHERE id = ? AND deleted_at IS NULL", (job_id,))
            .fetchone()
        )
        return _job_from_row(row) if row is not None else None

    def list_jobs(
        self, *, status: str | None = None, after: str | None = None, limit: int = 20
    ) -> tuple[list[JobRecord], bool]:
        """Newest first; `after` is the id of the last job of the previous page."""
        where, args = ["deleted_at IS NULL"], []
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if after is not None:
            where.append("seq < COALESCE((SELECT seq FROM jobs WHERE id = ?), -1)")
            args.append(after)
        sql = "SELECT * FROM jobs WHERE " + " AND ".join(where) + " ORDER BY seq DESC LIMIT ?"
        rows = self._conn().execute(sql, (*args, limit + 1)).fetchall()
        return [_job_from_row(r) for r in rows[:limit]], len(rows) > limit

    def jobs_with_status(self, statuses: Iterable[str]) -> list[JobRecord]:
        """Jobs in these states, in queue order: priority high first, then FIFO."""
        wanted = list(statuses)
        marks = ",".join("?" * len(wanted))
        rows = self._conn().execute(
            f"SELECT * FROM jobs WHERE status IN ({marks}) AND deleted_at IS NULL "
            "ORDER BY priority DESC, seq ASC",
            wanted,
        )
        return [_job_from_row(r) for r in rows.fetchall()]

    def jobs_with_worker(self) -> list[JobRecord]:
        rows = self._conn().execute("SELECT * FROM jobs WHERE worker_pid IS NOT NULL")
        return [_job_from_row(r) for r in rows.fetchall()]

    def count_by_status(self) -> dict[str, int]:
        rows = self._conn().execute(
            "SELECT status, COUNT(*) AS n FROM jobs WHERE deleted_at IS NULL GROUP BY status"
        )
        return {r["status"]: r["n"] for r in rows.fetchall()}

    def update_job(self, job_id: str, **fields: Any) -> JobRecord | None:
        """Set columns of a job regardless of its state (pid, progress); not for status."""
        if "status" in fields:
            raise ValueError("change a status with transition(), which compares and sets")
        if not fields:
            return self.get_job(job_id)
        with self._write() as conn:
            self._update(conn, job_id, fields)
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job_from_row(row) if row is not None else None

    @staticmethod
    def _update(conn: sqlite3.Connection, job_id: str, fields: dict[str, Any]) -> int:
        unknown = set(fields) - _JOB_COLUMNS
        if unknown:
            raise ValueError(f"unknown job columns: {sorted(unknown)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        values = [_encode(k, v) for k, v in fields.items()]
        cur = conn.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*values, job_id))
        return cur.rowcount

    def transition(
        self,
        job_id: str,
        from_statuses: Iterable[str],
        to: str,
        *,
        message: str | None = None,
        level: str = "info",
        event_data: dict[str, Any] | None = None,
        max_queued: int | None = None,
        **fields: Any,
    ) -> tuple[JobRecord, EventRecord] | None:
        """Compare-and-set the status and record its `status` event, atomically.

        Returns None (and changes nothing) when the job is not in one of `from_statuses`.
        A terminal status never changes, whatever `from_statuses` says. With `max_queued`,
        a move to queued raises TooManyRequests when that many are queued already.
        """
        allowed = [s for s in from_statuses if s not in TERMINAL_STATUSES]
        if not allowed:
            return None
        with self._write() as conn:
            row = conn.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["status"] not in allowed:
                return None
            previous = row["status"]
            if to == "queued" and previous != "queued":
                _check_queue_cap(conn, max_queued)
            if to in TERMINAL_STATUSES and "finished_at" not in fields:
                fields["finished_at"] = _now()
            self._update(conn, job_id, {"status": to, **fields})
            data = {"status": to, "previous": previous, **(event_data or {})}
            event = self._insert_event(
                conn,
                job_id,
                type_="status",
                level=level,
                message=message or f"job {to}",
                data=data,
            )
            job = _job_from_row(
                conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            )
        return job, event

    def is_deleted(self, job_id: str) -> bool:
        """Whether a job was deleted (DELETE /v1/jobs/{id}); False for no such job."""
        row = (
            self._conn()
            .execute("SELECT 1 FROM jobs WHERE id = ? AND deleted_at IS NOT NULL", (job_id,))
            .fetchone()
        )
        return row is not None

    def mark_deleted(self, job_id: str) -> JobRecord | None:
        """Mark a finished job deleted and drop its events and checkpoint rows, atomically.

        Returns the job as it was, or None when there is no such (undeleted) job.
        Raises Conflict when the job has not finished.
        """
        with self._write() as conn:
            row = conn.execute(
                "SELECT * FROM jobs WHERE id = ? AND deleted_at IS NULL", (job_id,)
            ).fetchone()
            if row is None:
                return None
            if row["status"] not in TERMINAL_STATUSES:
                raise Conflict(
                    f"job {job_id} is {row['status']}; only a finished job (succeeded, failed "
                    "or cancelled) can be deleted: cancel it first",
                    code="job_not_deletable",
                    param="job_id",
                )
            conn.execute("UPDATE jobs SET deleted_at = ? WHERE id = ?", (_now(), job_id))
            conn.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
            conn.execute("DELETE FROM checkpoints WHERE job_id = ?", (job_id,))
        return _job_from_row(row)

    # ------------------------------------------------------------ events

    @staticmethod
    def _insert_event(
        conn: sqlite3.Connection,
        job_id: str,
        *,
        type_: str,
        level: str,
        message: str,
        data: dict[str, Any],
    ) -> EventRecord:
        # Inside the write transaction, so MAX + 1 cannot race: ids are dense and ordered.
        next_id = conn.execute(
            "SELECT COALESCE(MAX(id), 0) + 1 FROM events WHERE job_id = ?", (job_id,)
        ).fetchone()[0]
        event = EventRecord(
            id=next_id,
            job_id=job_id,
            created_at=_now(),
            level=level,
            type=type_,
            message=message,
            data=data,
        )
        conn.execute(
            "INSERT INTO events (job_id, id, created_at, level, type, message, data) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (job_id, event.id, event.created_at, level, type_, message, json.dumps(data)),
        )
        return event

    def append_event(
        self,
        job_id: str,
        *,
        type_: str,
        level: str,
        message: str,
        data: dict[str, Any],
        job_fields: dict[str, Any] | None = None,
        checkpoint: CheckpointRecord | None = None,
    ) -> EventRecord:
        """Store one event, with the job columns and checkpoint row it implies, atomically."""
        with self._write() as conn:
            event = self._insert_event(
                conn, job_id, type_=type_, level=level, message=message, data=data
            )
            if job_fields:
                self._update(conn, job_id, job_fields)
            if checkpoint is not None:
                conn.execute(
                    "INSERT OR REPLACE INTO checkpoints "
                    "(job_id, step, created_at, path, size_bytes, metrics) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        checkpoint.job_id,
                        checkpoint.step,
                        checkpoint.created_at,
                        checkpoint.path,
                        checkpoint.size_bytes,
                        json.dumps(checkpoint.metrics),
                    ),
                )
        return event

    def list_events(
        self, job_id: str, *, after: int = 0, limit: int = 100, type_: str | None = None
    ) -> list[EventRecord]:
        """Events with id > `after`, ascending."""
        sql = "SELECT * FROM events WHERE job_id = ? AND id > ?"
        args: list[Any] = [job_id, after]
        if type_ is not None:
            sql += " AND type = ?"
            args.append(type_)
        sql += " ORDER BY id ASC LIMIT ?"
        rows = self._conn().execute(sql, (*args, limit)).fetchall()
        return [_event_from_row(r) for r in rows]

    def last_events(self, job_id: str, *, limit: int) -> list[EventRecord]:
        """The newest `limit` events, ascending."""
        rows = (
            self._conn()
            .execute(
                "SELECT * FROM (SELECT * FROM events WHERE job_id = ? ORDER BY id DESC LIMIT ?) "
                "ORDER BY id ASC",
                (job_id, limit),
            )
            .fetchall()
        )
        return [_event_from_row(r) for r in rows]

    def count_events(self) -> int:
        return int(self._conn().execute("SELECT COUNT(*) FROM events").fetchone()[0])

    # ------------------------------------------------------------ checkpoints

    def list_checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        rows = self._conn().execute(
            "SELECT * FROM checkpoints WHERE job_id = ? ORDER BY step ASC", (job_id,)
        )
        return [_checkpoint_from_row(r) for r in rows.fetchall()]

    def delete_checkpoints(self, job_id: str, steps: Iterable[int]) -> None:
        with self._write() as conn:
            conn.executemany(
                "DELETE FROM checkpoints WHERE job_id = ? AND step = ?",
                [(job_id, step) for step in steps],
            )

    def get_checkpoint(self, job_id: str, step: int) -> CheckpointRecord | None:
        row = (
            self._conn()
            .execute("SELECT * FROM checkpoints WHERE job_id = ? AND step = ?", (job_id, step))
            .fetchone()
        )
        return _checkpoint_from_row(row) if row is not None else None

    # ------------------------------------------------------------ files

    def add_file(self, record: FileRecord) -> FileRecord:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO files (id, filename, bytes, sha256, line_count, format, created_at, path) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.filename,
                    record.bytes,
                    record.sha256,
                    record.line_count,
                    record.format,
                    record.created_at,
                    record.path,
                ),
            )
        return record

    def get_file(self, file_id: str) -> FileRecord | None:
        row = self._conn().execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return _file_from_row(row) if row is not None else None

    def list_files(
        self, *, after: str | None = None, limit: int = 100
    ) -> tuple[list[FileRecord], bool]:
        sql = "SELECT * FROM files"
        args: list[Any] = []
        if after is not None:
            sql += " WHERE seq < COALESCE((SELECT seq FROM files WHERE id = ?), -1)"
            args.append(after)
        sql += " ORDER BY seq DESC LIMIT ?"
        rows = self._conn().execute(sql, (*args, limit + 1)).fetchall()
        return [_file_from_row(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> FileRecord | None:
        """Delete a file's row; None when there is none.

        Raises Conflict (`file_in_use`) while an unfinished job trains or validates on it:
        such a job reads the file again at every resume. Checked in the same transaction
        as the delete, so no job can start using it in between.
        """
        with self._write() as conn:
            row = conn.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
            if row is None:
                return None
            marks = ",".join("?" * len(_FILE_HOLDING_STATUSES))
            users = conn.execute(
                f"SELECT id, status FROM jobs WHERE status IN ({marks}) AND deleted_at IS NULL "
                "AND (json_extract(spec, '$.data.train') = ? "
                "OR json_extract(spec, '$.data.valid') = ?) ORDER BY seq",
                (*_FILE_HOLDING_STATUSES, file_id, file_id),
            ).fetchall()
            if users:
                jobs = [{"id": u["id"], "status": u["status"]} for u in users]
                named = ", ".join(f"{j['id']} ({j['status']})" for j in jobs[:10])
                more = f" and {len(jobs) - 10} more" if len(jobs) > 10 else ""
                raise Conflict(
                    f"file {file_id} is used by {len(jobs)} unfinished job(s): {named}{more}; "
                    "they read it again at every resume. Let them finish, or cancel them "
                    "(POST /v1/jobs/{id}/cancel, `rp cancel JOB`), then delete the file",
                    code="file_in_use",
                    param="file_id",
                    details={"jobs": jobs},
                )
            conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return _file_from_row(row)


def _check_queue_cap(conn: sqlite3.Connection, max_queued: int | None) -> None:
    """Inside a write transaction: raise TooManyRequests when the queue is at its cap."""
    if max_queued is None:
        return
    queued = conn.execute(
        "SELECT COUNT(*) FROM jobs WHERE status = 'queued' AND deleted_at IS NULL"
    ).fetchone()[0]
    if queued >= max_queued:
        raise TooManyRequests(
            f"the queue holds RP_MAX_QUEUED={max_queued} jobs; try again when some have started",
            code="queue_full",
        )


def _file_from_row(row: sqlite3.Row) -> FileRecord:
    values = {k: row[k] for k in row.keys() if k != "seq"}  # noqa: SIM118
    return FileRecord(**values)
