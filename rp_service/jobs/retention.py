"""What a finished job leaves on disk: its checkpoints pruned, the whole job deleted, and
the free-space floor that submissions and checkpoints must keep."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from rp_service.checkpoint_dirs import remove_checkpoint_dir
from rp_service.errors import DiskFull
from rp_service.jobs.store import JobRecord, Store
from rp_service.settings import Settings

__all__ = ["check_free_space", "delete_job", "prune_checkpoints"]

log = logging.getLogger(__name__)


def check_free_space(settings: Settings, *, what: str = "a new job") -> None:
    """Raise DiskFull when the data directory has less than RP_MIN_FREE_BYTES free."""
    free = shutil.disk_usage(settings.data_dir).free
    if free < settings.min_free_bytes:
        raise DiskFull(
            f"the daemon's disk is full ({free} bytes free in RP_DATA_DIR, below "
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


def delete_job(settings: Settings, store: Store, job_id: str) -> JobRecord | None:
    """Mark a finished job deleted, then remove its directory (checkpoints, outputs, log).

    Blocking. Returns the job, or None when there is none; Conflict if it has not ended.
    """
    job = store.mark_deleted(job_id)
    if job is not None:
        shutil.rmtree(settings.jobs_dir / job_id, ignore_errors=True)
        log.info("job %s deleted with its files", job_id)
    return job
