"""Durable writes: under its name a file or folder is whole, old or new, even across a crash.

Every writer whose result must survive a crash of the process or of the machine goes
through here, in one order:

1. write the new content at a temporary name in the same directory (a rename never
   crosses file systems, and a reader never opens the temporary name as the real one);
2. fsync it (a folder: every file and folder in it), so its bytes are on disk before
   its name can point at them;
3. rename it over the real name (atomic on POSIX: readers see the old or the new);
4. fsync the directory, so the rename itself survives a power loss.

A folder that replaces a folder cannot be renamed over it (os.replace refuses a non-empty
one): the two are swapped in one step (Linux's renameat2 with RENAME_EXCHANGE) and the old
one, now under the temporary name, removed. Where the file system cannot swap, the old
one is renamed aside first; a crash between those two renames leaves no folder under the
name, the new one complete under its temporary name.

Temporary names start with `TMP_PREFIX`: whoever owns a directory removes leftovers of a
crash by that prefix (rp_service.worker.checkpoint.remove_partial). Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "TMP_PREFIX",
    "commit",
    "fsync_path",
    "fsync_tree",
    "replacing",
    "tmp_path",
    "write_bytes",
]

TMP_PREFIX = ".tmp-"


def tmp_path(target: Path, *, tag: str = "") -> Path:
    """A temporary sibling of `target`, unique to this process: `.tmp-<tag><name>-<pid>`."""
    return target.with_name(f"{TMP_PREFIX}{tag}{target.name}-{os.getpid()}")


def fsync_path(path: Path) -> None:
    """Flush one file's bytes, or one directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync a file, or a folder with everything in it (children before their folder)."""
    if path.is_dir():
        for child in path.iterdir():
            fsync_tree(child)
    fsync_path(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` atomically; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28, or not Linux
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this file system cannot
        return False
    raise OSError(code, os.strerror(code), str(b))


def commit(tmp: Path, target: Path) -> None:
    """Make the complete `tmp` (a file or a folder) `target`: steps 2 to 4 above."""
    fsync_tree(tmp)
    if tmp.is_dir() and target.is_dir():
        if _exchange(tmp, target):
            fsync_path(target.parent)
            _remove(tmp)  # the old folder, under the temporary name now
            return
        old = tmp_path(target, tag="old-")
        _remove(old)
        target.rename(old)
        os.replace(tmp, target)
        fsync_path(target.parent)
        _remove(old)
        return
    os.replace(tmp, target)
    fsync_path(target.parent)


@contextlib.contextmanager
def replacing(target: Path, *, directory: bool = False, tmp: Path | None = None) -> Iterator[Path]:
    """Yield the temporary path to write `target`'s new content at; commit it when the
    block ends, remove it when the block raises (e.g. ENOSPC: the space comes back).

    Args:
        directory: the new content is a folder (made empty before the block runs).
        tmp: the temporary path, where its owner cleans up by another name than
            `TMP_PREFIX` (uploads: `*.partial`); a sibling of `target`.
    """
    tmp = tmp if tmp is not None else tmp_path(target)
    _remove(tmp)  # left by an earlier process with this pid
    if directory:
        tmp.mkdir(parents=True)
    try:
        yield tmp
        commit(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def write_bytes(target: Path, data: bytes, *, mode: int = 0o666) -> None:
    """Write `data` as the whole content of `target`, durably; `mode` (before the umask)
    holds from the first byte (a token file is never readable by others, not even while
    it is written)."""
    with replacing(target) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
