"""Checkpoint folders on disk, as the worker writes them and the daemon prunes them.

A committed checkpoint is a folder `step-N` holding its `state.json`; a folder whose name
starts with `TMP_PREFIX` is a write or a removal in progress, which the worker deletes on
its next start (`rp_service.worker.checkpoint.remove_partial`). Both sides rename before
they write or delete, so neither a reader nor a crash ever sees a `step-N` folder that is
half-written or half-deleted. Torch-free: the daemon imports it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rp_service.durable import TMP_PREFIX

__all__ = ["TMP_PREFIX", "remove_checkpoint_dir"]


def remove_checkpoint_dir(path: Path) -> None:
    """Delete the committed checkpoint folder `path` (gone already: nothing to do). It is
    renamed to a temporary name first, then removed file by file."""
    trash = path.with_name(f"{TMP_PREFIX}del-{path.name}")
    if trash.exists():  # a removal of the same name that a crash interrupted
        shutil.rmtree(trash, ignore_errors=True)
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)
