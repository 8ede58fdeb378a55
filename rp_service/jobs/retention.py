"""What a finished job leaves on disk: its checkpoints pruned, the whole job deleted, and
the free-space floor that submissions and checkpoints must keep."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

from rp_service.checkpoint_dirs import remove_checkpoint_dir
from rp_service.errors import DiskFull
from rp_service.jobs.store import JobRecord, Store
from rp_service.settings import Settings

__all__ = ["TRASH_PREFIX", "check_free_space", "delete_job", "prune_checkpoints", "sweep_trash"]

log = logging.getLogger(__name__)

# A deleted job's folder is renamed to this prefix + its id before it is removed.
TRASH_PREFIX = ".trash-"


def check_free_space(settings: Settings, *, what: str = "a new job", need: int = 0) -> None:
    """Raise DiskFull when the data directory would keep less than RP_MIN_FREE_BYTES free
    after `need` more bytes are written."""
    free = shutil.disk_usage(settings.data_dir).free
    if free - need < settings.min_free_bytes:
        after = f", {need} more would be written" if need else ""
        raise DiskFull(
            f"the daemon's disk is full ({free} bytes free in RP_DATA_DIR{after}; "
            f"RP_MIN_FREE_BYTES={settings.min_free_bytes}): {what} was refused; delete "
            "finished jobs (DELETE /v1/jobs/{id}, `rp rm JOB`) or free space",
        )


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except (ValueError, OSError):
        return False
    return True


def prune_checkpoints(settings: Settings, store: Store, job_id: str) -> int:
    """Delete all but the newest RP_KEEP_FINISHED_CHECKPOINTS checkpoints of an ended job.

    Blocking. Returns how many were removed. Only folders inside the job's directory are
    removed, whatever a checkpoint row says.
    """
    records = store.list_checkpoints(job_id)  # ascending steps
    keep = settings.keep_finished_checkpoints
    doomed = records[: max(len(records) - keep, 0)]
    job_dir = settings.jobs_dir / job_id
    for record in doomed:
        path = Path(record.path)
        if record.path and _inside(path, job_dir):
            # Renamed first: a reader listing the folder (or a crash) never sees a step-N
            # without its state.json (the chaos soak caught one mid-removal).
            remove_checkpoint_dir(path)
    if doomed:
        store.delete_checkpoints(job_id, [r.step for r in doomed])
        log.info("job %s: removed %d checkpoint(s), kept %d", job_id, len(doomed), keep)
    return len(doomed)


def _remove_tree(path: Path) -> bool:
    """Remove a folder, logging each file that cannot be removed; whether it is all gone."""
    failures: list[str] = []

    def failed(func: object, name: str, exc: object) -> None:
        failures.append(name)
        log.error("cannot remove %s (%s): %s", name, getattr(func, "__name__", func), exc)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=lambda f, n, info: failed(f, n, info[1]))
    return not failures


def _trash(settings: Settings, job_id: str) -> bool:
    """Rename a job's folder to its trash name (same filesystem: atomic), then remove it.

    A crash (kill -9) mid-removal leaves only a trash folder, which `sweep_trash` removes
    at the next start; never a job folder half gone. Returns whether all of it is gone.
    """
    folder = settings.jobs_dir / job_id
    trash = settings.jobs_dir / f"{TRASH_PREFIX}{job_id}"
    if trash.exists() and not _remove_tree(trash):
        return False
    try:
        folder.rename(trash)
    except FileNotFoundError:
        return not trash.exists()
    return _remove_tree(trash)


def delete_job(settings: Settings, store: Store, job_id: str) -> JobRecord | None:
    """Mark a finished job deleted, then remove its directory (checkpoints, outputs, log).

    Blocking. Returns the job, or None when there is none; Conflict if it has not ended.
    What cannot be removed now is logged and left to `sweep_trash` at the next start.
    """
    job = store.mark_deleted(job_id)
    if job is not None:
        if _trash(settings, job_id):
            log.info("job %s deleted with its files", job_id)
        else:
            log.error("job %s deleted, but some of its files remain: removed at next start", job_id)
    return job


def sweep_trash(settings: Settings, store: Store) -> int:
    """At start-up: remove what deletes left behind (a crash between the row and the
    files, or a removal that failed). Blocking; returns how many folders were swept."""
    if not settings.jobs_dir.is_dir():
        return 0
    swept = 0
    for child in sorted(settings.jobs_dir.iterdir()):
        if child.name.startswith(TRASH_PREFIX):
            swept += _remove_tree(child)
        elif child.is_dir() and store.is_deleted(child.name):
            swept += _trash(settings, child.name)
    if swept:
        log.info("removed %d deleted job folder(s) left by an earlier daemon", swept)
    return swept
