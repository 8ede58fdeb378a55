"""Thread helpers: named events and semaphores, and worker threads that keep their errors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["AnnotatedEvent", "AnnotatedSemaphore", "RoundPipeThread", "roundpipe_threads"]

log = logging.getLogger(__name__)

roundpipe_threads: list[RoundPipeThread] = []
"""Every RoundPipe thread created so far (for debugging dumps)."""


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
        roundpipe_threads.append(self)

    def _guarded(self) -> None:
        try:
            self._work()
        except BaseException:
            log.exception("RoundPipe thread %s died", self.name)
            raise
