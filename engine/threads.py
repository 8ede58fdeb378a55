"""Thread helpers: named events and semaphores, worker threads that keep their errors, and
the registry of open models that closes them (and so stops their threads) at exit."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "AnnotatedEvent",
    "AnnotatedSemaphore",
    "RoundPipeThread",
    "any_open",
    "mark_closed",
    "roundpipe_threads",
    "track_open",
]

log = logging.getLogger(__name__)

roundpipe_threads: weakref.WeakSet[RoundPipeThread] = weakref.WeakSet()
"""Every RoundPipe thread still referenced (for debugging dumps)."""


class AnnotatedEvent(threading.Event):
    """A threading.Event with a name that says what it waits on."""

    def __init__(self, name: str, *, set_: bool = False) -> None:
        super().__init__()
        self.name = name
        if set_:
            self.set()

    def __repr__(self) -> str:
        return f"AnnotatedEvent({self.name!r}, set={self.is_set()})"


class AnnotatedSemaphore(threading.Semaphore):
    """A threading.Semaphore with a name that says what it counts."""

    def __init__(self, name: str, value: int = 0) -> None:
        super().__init__(value)
        self.name = name

    def __repr__(self) -> str:
        return f"AnnotatedSemaphore({self.name!r})"


class RoundPipeThread(threading.Thread):
    """Daemon thread that logs an uncaught exception instead of dying silently.

    Work loops catch their own errors and hand them to the caller's next call; this is
    the last line for a bug in the loop itself.
    """

    def __init__(self, target: Callable[[], Any], name: str, **kwargs: Any) -> None:
        super().__init__(target=self._guarded, name=name, daemon=True, **kwargs)
        self._work = target
        self.is_active = False
        roundpipe_threads.add(self)

    def _guarded(self) -> None:
        try:
            self._work()
        except BaseException:
            log.exception("RoundPipe thread %s died", self.name)
            raise


# ---- open models ---------------------------------------------------------------------
class _Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Any] = weakref.WeakSet()  # weak: a model dropped is not kept alive
_open_lock = threading.Lock()
_exit_hook_registered = False


def track_open(owner: _Closable) -> None:
    """Remember `owner` as open: `owner.close()` runs at interpreter exit unless called before.

    atexit runs while other threads can still take the GIL, before the interpreter
    finalizes: a close there lets every engine thread and collective finish first.
    """
    global _exit_hook_registered
    with _open_lock:
        _open.add(owner)
        if not _exit_hook_registered:
            # Registered after torch is imported, so it runs before torch's own exit hooks.
            atexit.register(_close_open_at_exit)
            _exit_hook_registered = True


def mark_closed(owner: object) -> bool:
    """Forget `owner`; False when it was not open (closed already: nothing to do)."""
    with _open_lock:
        if owner not in _open:
            return False
        _open.discard(owner)
        return True


def any_open() -> bool:
    """Whether a tracked model is still open (the shared threads are still wanted)."""
    with _open_lock:
        return len(_open) > 0


def _close_open_at_exit() -> None:
    for owner in list(_open):
        try:
            owner.close()
        except Exception:
            log.exception("closing %s at exit failed", type(owner).__name__)
