"""The daemon's hold on its data directory: one daemon per directory, private files, the token.

`DataDir.claim()` runs before the store is opened: it makes the directory 0700 (and the
process umask 0o077, so every file after it is 0600), takes an exclusive `flock` on
`daemon.lock` (the holder's pid written in it), removes the `.partial` uploads of a daemon
that was killed, and keeps the lock until `release()` or the process ends. A second daemon
gets `DataDirLocked` naming the first one's pid, before it can touch that one's workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from pathlib import Path

from rp_service.durable import write_bytes

__all__ = ["DataDir", "DataDirLocked", "read_token", "write_token"]

log = logging.getLogger(__name__)

_PRIVATE_UMASK = 0o077
_TOKEN_BYTES = 32


class DataDirLocked(RuntimeError):
    """Another daemon holds the data directory's lock; `pid` is its process id (or None)."""

    def __init__(self, message: str, *, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def read_token(path: Path) -> str | None:
    """The token stored at `path`, or None when there is no readable, non-empty one."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def write_token(path: Path) -> str:
    """A new random token written to `path` (0600, atomically: never half a token)."""
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    write_bytes(path, f"{token}\n".encode(), mode=0o600)
    return token


class DataDir:
    """The data directory of one daemon; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._umask: int | None = None

    @property
    def lock_path(self) -> Path:
        return self.path / "daemon.lock"

    @property
    def token_path(self) -> Path:
        return self.path / "token"

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def claim(self) -> None:
        """Private modes, the lock, stale partial uploads removed. Raises DataDirLocked."""
        if self.held:
            return
        # Process-wide: the store, uploads and job files are 0600 (restored by release()).
        self._umask = os.umask(_PRIVATE_UMASK)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)  # an existing directory of an older daemon was 0755
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            os.umask(self._umask)
            holder = f"pid {pid}" if pid is not None else "another process"
            raise DataDirLocked(
                f"the data directory {self.path} is in use by another daemon ({holder}, "
                f"lock {self.lock_path}): stop that daemon or set RP_DATA_DIR to another "
                "directory",
                pid=pid,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        self._make_private()
        self.remove_partials()

    def release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock
        if self._umask is not None:
            os.umask(self._umask)
            self._umask = None

    def token(self) -> str:
        """The stored token, made (and stored) on the first start."""
        return read_token(self.token_path) or write_token(self.token_path)

    def remove_partials(self) -> int:
        """Delete `.partial` uploads left by a daemon that died mid-upload; returns how many."""
        removed = 0
        files = self.path / "files"
        for partial in files.glob("*.partial") if files.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
                removed += 1
        spool = self.path / "tmp"
        for stale in spool.iterdir() if spool.is_dir() else ():
            with contextlib.suppress(OSError):
                stale.unlink()
        if removed:
            log.info("removed %d partial upload(s) of an earlier daemon", removed)
        return removed

    def _make_private(self) -> None:
        """0600 for the files an older daemon left readable (the store, uploads, the token)."""
        for name in ("rp.sqlite3", "rp.sqlite3-wal", "rp.sqlite3-shm", "token"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.path / name, 0o600)
        for sub in ("files", "jobs", "tmp"):
            folder = self.path / sub
            if folder.is_dir():
                os.chmod(folder, 0o700)
        files = self.path / "files"
        for upload in files.iterdir() if files.is_dir() else ():
            with contextlib.suppress(OSError):
                os.chmod(upload, 0o600)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
