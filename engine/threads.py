"""Thread helpers: named events and semaphores, worker threads that keep their errors, stack
dumps of the threads at work (what a Ctrl-C while RoundPipe waits prints), and the registry
of open models that closes them (and so stops their threads) at exit."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Protocol

__all__ = [
    "AnnotatedEvent",
    "AnnotatedSemaphore",
    "KeyboardInterruptRoundPipeThreads",
    "RoundPipeThread",
    "any_open",
    "dump_all_active_threads",
    "interruptible_wait",
    "is_threading_internal",
    "mark_closed",
    "print_trimmed_traceback",
    "roundpipe_threads",
    "thread_exception_print_lock",
    "track_open",
    "working",
]

log = logging.getLogger(__name__)

roundpipe_threads: weakref.WeakSet[RoundPipeThread] = weakref.WeakSet()
"""Every RoundPipe thread still referenced (for debugging dumps)."""

thread_exception_print_lock = threading.Lock()
"""Held while a thread's error or a stack dump is written, so two never interleave."""


class KeyboardInterruptRoundPipeThreads(KeyboardInterrupt):
    """Ctrl-C while the caller waited for RoundPipe's threads; the stacks of the threads at
    work were printed to stderr first (where a hung call was stuck)."""


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
            with thread_exception_print_lock:
                log.exception("RoundPipe thread %s died", self.name)
            raise


@contextlib.contextmanager
def working() -> Iterator[None]:
    """Mark the current RoundPipe thread as running user work (a job, an optimizer kernel)
    for the duration: `dump_all_active_threads` shows only such threads."""
    thread = threading.current_thread()
    if not isinstance(thread, RoundPipeThread):
        yield
        return
    thread.is_active = True
    try:
        yield
    finally:
        thread.is_active = False


_INTERNAL_FILES = frozenset(
    os.path.normcase(os.path.abspath(f)) for f in (threading.__file__, __file__)
)


def is_threading_internal(frame: FrameType) -> bool:
    """Whether `frame` is Python's threading machinery or this module's (noise in a dump)."""
    return os.path.normcase(os.path.abspath(frame.f_code.co_filename)) in _INTERNAL_FILES


def print_trimmed_traceback(frame: FrameType | None) -> None:
    """Print the stack that ends at `frame` to stderr, without threading's own frames."""
    if frame is None:
        print("  (no frame: the thread is not running Python code)", file=sys.stderr)
        return
    kept: list[FrameType] = []
    cur: FrameType | None = frame
    while cur is not None:
        if not is_threading_internal(cur):
            kept.append(cur)
        cur = cur.f_back
    summary = traceback.StackSummary.extract(
        ((f, f.f_lineno) for f in reversed(kept)), capture_locals=False
    )
    print("".join(summary.format()), end="", file=sys.stderr)


def dump_all_active_threads() -> None:
    """Print to stderr the stack of every RoundPipe thread now running user work."""
    frames = sys._current_frames()
    with thread_exception_print_lock:
        for thread in list(roundpipe_threads):
            if not (thread.is_alive() and thread.is_active):
                continue
            print(f"RoundPipe thread {thread.name} (at work):", file=sys.stderr)
            print_trimmed_traceback(frames.get(thread.ident or -1))


def interruptible_wait(wait: Callable[[], Any]) -> Any:
    """`wait()`, turning a Ctrl-C into KeyboardInterruptRoundPipeThreads after dumping the
    stacks of the threads at work (what the caller was waiting on)."""
    try:
        return wait()
    except KeyboardInterruptRoundPipeThreads:
        raise
    except KeyboardInterrupt:
        dump_all_active_threads()
        raise KeyboardInterruptRoundPipeThreads(
            "interrupted while waiting for RoundPipe's threads; the stacks of those at work "
            "are printed above"
        ) from None


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
