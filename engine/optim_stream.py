"""The optimizer stream: one thread that runs optimizer kernels (step_fn) in order.

`launch_optim_kernel(fn, ...)` queues work and returns at once; `synchronize_optim()` waits
until everything queued so far has run. An exception raised by a kernel is kept and raised
(as StepError) by the next `launch_optim_kernel` or `synchronize_optim` on the main thread,
after which the stream is usable again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from .errors import StepError
from .threads import RoundPipeThread, interruptible_wait, working

__all__ = [
    "OPTIM_STOP",
    "check_optim_error",
    "launch_optim_kernel",
    "on_optim_stream",
    "shutdown_optim",
    "synchronize_optim",
]

KernelQueueType = queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]

OPTIM_STOP = object()
"""Sentinel that stops the optimizer thread."""

kernel_queue: KernelQueueType = queue.Queue()
_lock = threading.Lock()
_thread: RoundPipeThread | None = None
_error: BaseException | None = None


def controller() -> None:
    """Optimizer thread: run queued kernels in order until OPTIM_STOP."""
    global _error
    while True:
        fn, args, kwargs = kernel_queue.get()
        try:
            if fn is OPTIM_STOP:
                return
            with working():
                fn(*args, **kwargs)
        except BaseException as exc:  # handed to the main thread's next call; first one wins
            if _error is None:
                _error = exc
        finally:
            # Let go of the kernel's arguments before a synchronize can return: a finished
            # call's state (engine.fold_ahead's kernel holds it) must not outlive the call.
            fn = args = kwargs = None  # type: ignore[assignment]
            kernel_queue.task_done()


def _ensure_thread() -> None:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = RoundPipeThread(controller, name="rp-optimizer")
            _thread.start()


def _raise_pending() -> None:
    global _error
    if _error is not None:
        exc, _error = _error, None
        raise StepError(f"step_fn failed on the optimizer thread: {exc!r}") from exc


def check_optim_error() -> None:
    """Raise (as StepError) the error a kernel left behind, if any, without waiting."""
    _raise_pending()


def on_optim_stream() -> bool:
    """True when called from the optimizer thread."""
    return _thread is not None and threading.current_thread() is _thread


def launch_optim_kernel(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Queue `fn(*args, **kwargs)` on the optimizer thread (run inline if already on it)."""
    if on_optim_stream():
        fn(*args, **kwargs)
        return
    _raise_pending()
    _ensure_thread()
    kernel_queue.put((fn, args, kwargs))


def synchronize_optim() -> None:
    """Wait until every queued kernel has run; raise a kernel's error if one failed."""
    if not on_optim_stream() and _thread is not None:
        interruptible_wait(kernel_queue.join)
    _raise_pending()


def shutdown_optim() -> None:
    """Stop the optimizer thread after the queued work (a later launch starts a new one)."""
    global _thread
    if _thread is not None and _thread.is_alive():
        kernel_queue.put((OPTIM_STOP, (), {}))  # type: ignore[arg-type]
        _thread.join()
    _thread = None
